"""The batch loop: one thread owns every batch from its admission to its final status.

The API (admit, cancel), the engine (each finished request) and the clock only post messages to it; every change to
a batch happens here, one at a time, so no state is shared and nothing is locked.
Per batch the loop

1. prepares: reads back the results files of a batch resumed after a restart (the files are the truth), then makes
   one streaming pass over the input file that validates it and counts its work in sequences (prompts x n);
2. runs: a second streaming pass feeds the engine a line at a time while fewer than ``window`` sequences of all
   batches are inside it; free room goes to the tenant with the fewest sequences inside, then to its batch with the
   fewest, round-robin among equals (``Turns``), so a small batch finishes promptly behind a huge one, and memory
   stays flat whatever the file's size;
3. writes: each finished request becomes one output or error line, appended whole at once and fsynced every
   ``flush_interval_s``; only then does it count as done (and the live counts get published);
4. finishes: ``finalizing`` -> ``completed`` once every line is durable, or ``cancelled``, ``expired``, ``failed``,
   each move checked against the one table in ``lifecycle``.

A storage fault (a full disk, an I/O error) pauses the batch it hit: its unwritten lines wait in memory, it takes no
new work, and the loop retries with backoff until the disk recovers, then resumes by itself. Results find their
request line through a map keyed by engine request id; a result whose id is no longer there (cancelled, expired) is
dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import msgspec

from batchgen.schemas import (
    BatchError,
    BatchErrors,
    BatchInputLine,
    BatchLineError,
    BatchObject,
    BatchOutputLine,
    sequences_of,
)
from batchgen.schemas.validation import DEFAULT_LIMITS, LineError, ValidationLimits, iter_input_lines

from ..engine.interface import EngineSubmitter
from ..engine.request import EngineRequest, EngineResult
from ..ids import new_line_id, new_request_id
from ..serving import BatchDefaults, OpenAIServing, RequestRejected
from ..storage.blobs import ResultsFile, ResultsLost
from ..storage.faults import storage_fault
from . import lifecycle
from .crashes import STRIKES_TO_QUARANTINE, CrashJournal, Key
from .results import Tally, recover, succeeded
from .stores import Results, Store
from .turns import Turns

log = logging.getLogger("batchgen.server.loop")

MAX_REPORTED_ERRORS = 100
SLICE_S = 0.02
"""The longest the loop reads one batch's files (preparing, expiring) before it looks at its messages again."""
TICK_S = 0.25
"""How often an idle loop with unfinished batches wakes: fsyncs due, retries due, completion windows."""
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 5.0
"""Backoff of a batch paused by a storage fault: the first wait, doubling up to the last."""
_encode = msgspec.json.Encoder().encode
T = TypeVar("T")


def default_window(max_num_seqs: int) -> int:
    """The engine's running set and a quarter more: enough queued to keep it full while the loop refills, few enough
    that a newcomer's requests wait in the engine behind a quarter of a running set at most."""
    return max_num_seqs + max(1, max_num_seqs // 4)


class CapacityExceeded(Exception):
    """Admitting the batch would put more than ``capacity`` sequences in the queue."""

    def __init__(self, requested: int, queued: int, capacity: int) -> None:
        super().__init__(f"{requested} sequences asked, {queued} queued, capacity {capacity}")
        self.requested, self.queued, self.capacity = requested, queued, capacity

    @property
    def too_large(self) -> bool:
        """The batch alone is over the capacity: waiting will not help."""
        return self.requested > self.capacity


class LoopStopped(Exception):
    """The loop has stopped (the server is shutting down)."""


@dataclass(frozen=True, slots=True)
class LoopStatus:
    queued_sequences: int = 0
    """Work admitted and not finished, in sequences (prompts x n), running ones included."""
    active_batches: int = 0
    storage_fault: str | None = None
    """Why results cannot be written at the moment (a batch is paused), or ``None``."""


@dataclass(slots=True, eq=False)
class _Request:
    """A request line inside the engine: its engine requests and the results that have come back."""

    batch: _Batch
    line: BatchInputLine
    request_id: str
    requests: list[EngineRequest]
    results: list[EngineResult | None]
    work: int


@dataclass(slots=True)
class _Answer:
    """An output or error line on its way to disk; ``end`` is its file's size once appended."""

    line: BatchOutputLine
    data: bytes
    file: ResultsFile
    end: int = 0


@dataclass(slots=True, eq=False)
class _Batch:
    record: BatchObject
    owner: str
    status: str
    work: int
    """Sequences not answered yet: the upload's count until prepared, then exact."""
    defaults: BatchDefaults
    started: bool
    """It has (or had) results files: what it wrote must be read back before it can finish."""
    preparing: Iterator[None] | None = None
    total: int = 0
    errors: list[BatchError] = field(default_factory=list)
    """Of the input file, found while preparing."""
    lines: Iterator[BatchInputLine] | None = None
    """The unanswered lines not yet taken; ``None`` once exhausted (or stopped)."""
    taken: set[str] = field(default_factory=set)
    """custom_ids answered before a restart or taken from ``lines`` since: a new pass over the input skips them."""
    held: BatchInputLine | None = None
    """A line taken that waits for room in the engine."""
    on_probation_hold: bool = False
    """``held`` is a struck line waiting for the line on probation to leave the engine."""
    in_engine: dict[str, _Request] = field(default_factory=dict)
    running: int = 0
    """Sequences inside the engine: its share, which the turns even out."""
    results: Results | None = None
    tally: Tally = field(default_factory=Tally)
    """What is durably written."""
    unwritten: deque[_Answer] = field(default_factory=deque)
    unsynced: list[_Answer] = field(default_factory=list)
    published: bool = True
    """The store's counts match ``tally``."""
    synced_at: float = 0.0
    stopping: str | None = None
    """``cancelled`` or ``expired``: no new work; finish once what is answered is written."""
    failure: str | None = None
    fault: str | None = None
    retry_at: float = 0.0
    backoff: float = RETRY_FIRST_S

    @property
    def id(self) -> str:
        return self.record.id

    def files(self) -> list[ResultsFile]:
        return [] if self.results is None else list(dict.fromkeys(self.results))


class BatchLoop:
    def __init__(
        self,
        store: Store,
        serving: OpenAIServing,
        engine: EngineSubmitter,
        *,
        capacity: int,
        window: int,
        flush_interval_s: float = 0.5,
        limits: ValidationLimits = DEFAULT_LIMITS,
        journal: CrashJournal | None = None,
    ) -> None:
        self.store = store
        self.serving = serving
        self.engine = engine
        self.capacity = capacity
        self.window = window
        """Most sequences of all batches inside the engine (running or queued there)."""
        self.flush_interval_s = min(flush_interval_s, 1.0)
        self.limits = limits
        self.journal = journal
        """Notes what is inside the engine, so that a line that kills the process is pinned and quarantined."""
        self._probation: Key | None = None
        """The one struck line inside the engine, if any (see ``crashes``)."""
        self.status = LoopStatus()
        """A snapshot for the API, replaced (never mutated) after every round."""
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="batchgen-loop", daemon=True)
        self._stopped = False
        self._batches: dict[str, _Batch] = {}
        self._turns: Turns[_Batch] = Turns()
        self._waiting_for_room: _Batch | None = None
        self._requests: dict[str, tuple[_Request, int]] = {}
        """Engine request id -> its request line and its index there, while its result is awaited."""
        self._in_engine = 0
        """Sequences inside the engine."""
        self._next_expiry_check = 0.0

    # ---- posted from other threads ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Write and fsync what is answered, then stop (what is not answered yet resumes at the next start)."""
        self._stopped = True
        self._inbox.put(None)
        self._thread.join(timeout)

    def admit(self, batch: BatchObject, owner: str, sequences: int) -> Future[BatchObject]:
        """Record a new ``validating`` batch and run it, unless its ``sequences`` exceed the free capacity
        (``CapacityExceeded``)."""
        return self._ask(partial(self._admit, batch, owner, sequences))

    def cancel(self, batch_id: str, owner: str) -> Future[BatchObject | None]:
        """Cancel the batch if it can be; the batch as it now is (``None`` if ``owner`` has no such batch)."""
        return self._ask(partial(self._cancel, batch_id, owner))

    def _on_result(self, result: EngineResult) -> None:
        self._inbox.put(partial(self._take_result, result))

    def _ask(self, task: Callable[[Future[T]], None]) -> Future[T]:
        future: Future[T] = Future()
        if self._stopped:
            future.set_exception(LoopStopped())
        else:
            self._inbox.put(partial(task, future))
        return future

    # ---- the loop -----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for record, owner in self.store.unfinished():
                self._track(record, owner, record.request_counts.total)
        except Exception:
            log.exception("could not read the unfinished batches; they resume at the next start")
        while self._receive():
            try:
                self._round()
            except Exception:  # a bug: keep serving the other batches
                log.exception("a round of the batch loop failed")
        self._close()

    def _receive(self) -> bool:
        """Run the messages that came in (waiting for one while there is nothing to do); ``False`` on stop."""
        timeout = None if not self._batches else 0.0 if self._busy() else TICK_S
        try:
            task = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return True
        deadline = time.monotonic() + SLICE_S
        while task is not None:
            _run_task(task)
            if time.monotonic() > deadline:
                return True
            try:
                task = self._inbox.get_nowait()
            except queue.Empty:
                return True
        return False

    def _busy(self) -> bool:
        return any(
            batch.fault is None and (batch.preparing or (batch.stopping == "expired" and batch.lines))
            for batch in self._batches.values()
        )

    def _round(self) -> None:
        now = time.monotonic()
        self._expire_due()
        for batch in list(self._batches.values()):
            if batch.fault is None or now >= batch.retry_at:
                self._advance_safely(batch)
        self._refill()
        fault = next((batch.fault for batch in self._batches.values() if batch.fault), None)
        queued = sum(batch.work for batch in self._batches.values())
        self.status = LoopStatus(queued, len(self._batches), fault)

    def _close(self) -> None:
        while True:  # answer what was asked before the stop
            try:
                task = self._inbox.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                _run_task(task)
        for batch in self._batches.values():
            try:
                self._write(batch, sync=True)
            except Exception as exc:
                log.warning("batch %s: unwritten results dropped at shutdown (%s); they run again", batch.id, exc)
            for file in batch.files():
                file.close()
        if self.journal is not None:
            self.journal.close()

    # ---- admission and cancellation -----------------------------------------------------------------------------

    def _admit(self, batch: BatchObject, owner: str, sequences: int, reply: Future[BatchObject]) -> None:
        try:
            queued = sum(tracked.work for tracked in self._batches.values())
            if queued + sequences > self.capacity:
                raise CapacityExceeded(sequences, queued, self.capacity)
            self.store.insert(batch, owner)
            self._track(batch, owner, sequences)
        except Exception as exc:
            reply.set_exception(exc)
        else:
            log.info("batch %s created: %d sequence(s)", batch.id, sequences)
            reply.set_result(batch)

    def _track(self, record: BatchObject, owner: str, work: int) -> None:
        batch = _Batch(record, owner, record.status, work, BatchDefaults.of(record), record.status != "validating")
        batch.total = record.request_counts.total  # counted again while preparing, unless it is finalizing
        batch.preparing = self._prepare(batch)
        if batch.status == "cancelling":
            batch.stopping = "cancelled"
        self._batches[batch.id] = batch
        self._turns.add(owner, batch)

    def _cancel(self, batch_id: str, owner: str, reply: Future[BatchObject | None]) -> None:
        try:
            batch = self._batches.get(batch_id)
            if batch is not None and batch.owner == owner and batch.status in lifecycle.CANCELLABLE:
                self._move(batch, "cancelling")
                self._stop(batch, "cancelled")
            reply.set_result(self.store.get(batch_id, owner))
        except Exception as exc:
            reply.set_exception(exc)

    def _stop(self, batch: _Batch, reason: str) -> None:
        """Take no more work for the batch and drop what the engine holds of it; an expired batch answers every
        request not done with ``batch_expired``."""
        batch.stopping = reason
        if not batch.started:
            batch.preparing = None
        ids = [request.request_id for entry in batch.in_engine.values() for request in entry.requests]
        for request_id in ids:
            if (found := self._requests.pop(request_id, None)) is not None:
                entry, index = found
                self._in_engine -= entry.requests[index].params.n
        batch.running = 0
        if ids:
            self.engine.abort(ids)
        for entry in batch.in_engine.values():
            self._left_engine(batch, entry.line.custom_id, answered=False)
        unanswered = [entry.line for entry in batch.in_engine.values()] + ([batch.held] if batch.held else [])
        batch.in_engine.clear()
        batch.held = None
        if reason == "expired":
            for line in unanswered:
                self._answer(batch, _expired_line(line.custom_id), sequences_of(line.body))
        else:
            batch.lines = None
            batch.work = 0

    def _expire_due(self) -> None:
        now = time.time()
        if now < self._next_expiry_check:
            return
        self._next_expiry_check = now + 1.0
        for batch in self._batches.values():
            expires_at = batch.record.expires_at
            due = expires_at is not None and now >= expires_at
            if due and batch.stopping is None and batch.status in ("validating", "in_progress"):
                log.info("batch %s: the completion window has passed", batch.id)
                self._stop(batch, "expired")

    # ---- one batch's progress -----------------------------------------------------------------------------------

    def _advance_safely(self, batch: _Batch) -> None:
        try:
            self._advance(batch)
        except Exception as exc:
            self._trouble(batch, exc)
            return
        if batch.fault is not None:
            log.warning("batch %s: storage recovered; resuming", batch.id)
            batch.fault, batch.backoff = None, RETRY_FIRST_S

    def _advance(self, batch: _Batch) -> None:
        """Take every step the batch is ready for. Each step is idempotent, so after a storage fault the same call
        retries whatever had not happened."""
        if batch.failure is not None:
            self._finish(batch, "failed", errors=_internal_error(batch.failure))
            return
        if batch.preparing is not None:
            deadline = time.monotonic() + SLICE_S
            try:
                for _ in batch.preparing:
                    if time.monotonic() > deadline:
                        return
            except Exception:
                batch.preparing = self._prepare(batch)  # a retry starts over
                raise
            batch.preparing = None
            batch.taken = set(batch.tally.done)
            if batch.status in ("validating", "in_progress") and not batch.errors:
                batch.lines = self._unanswered(batch)
        if batch.stopping is None and batch.errors:
            self._finish(batch, "failed", errors=BatchErrors(data=batch.errors), total=0)  # nothing was run
            return
        if batch.status == "validating":
            if batch.stopping:  # expired while validating: it never starts
                self._finish(batch, batch.stopping)
                return
            self._start(batch)
        if batch.status == "in_progress" and batch.results is None:
            batch.results = self.store.open_results(batch.record)
        if batch.stopping == "expired" and batch.lines is not None:
            self._answer_expired(batch)
        drained = self._drained(batch)
        self._write(batch, sync=drained or batch.stopping is not None)
        if not drained or batch.unwritten or batch.unsynced or not batch.published:
            return
        missing = batch.total - len(batch.tally.done)
        if batch.stopping is None and missing > 0:  # ``completed`` only with a line for every custom_id
            raise RuntimeError(f"{missing} request(s) have no line after the input was drained")
        self._finish(batch, batch.stopping or "completed")

    def _prepare(self, batch: _Batch) -> Iterator[None]:
        """Read back what a resumed batch had written, then validate the input and count its unanswered work."""
        batch.tally, batch.errors = Tally(), []
        for path in self.store.results_paths(batch.record):
            yield from recover(path, batch.tally)
        if batch.status not in ("validating", "in_progress"):  # cancelling or finalizing: nothing more to write
            batch.work = 0
            return
        batch.total = batch.work = 0
        endpoint = batch.record.endpoint or None
        for item in iter_input_lines(self.store.input_path(batch.record), endpoint=endpoint, limits=self.limits):
            if isinstance(item, LineError):
                if len(batch.errors) < MAX_REPORTED_ERRORS:
                    batch.errors.append(item.to_batch_error())
            else:
                batch.total += 1
                if item.custom_id not in batch.tally.done:
                    batch.work += sequences_of(item.body)
            yield

    def _unanswered(self, batch: _Batch) -> Iterator[BatchInputLine]:
        endpoint = batch.record.endpoint or None
        for item in iter_input_lines(self.store.input_path(batch.record), endpoint=endpoint, limits=self.limits):
            if isinstance(item, LineError):
                raise RuntimeError(f"the input file changed after it was validated: line {item.line}: {item.message}")
            if item.custom_id not in batch.taken:
                batch.taken.add(item.custom_id)
                yield item

    def _start(self, batch: _Batch) -> None:
        """validating -> in_progress, with empty results files that a reader can follow while the batch runs."""
        lifecycle.check(batch.status, "in_progress")
        fields = {"status": "in_progress", "in_progress_at": _now(), "total": batch.total}
        batch.record = self.store.start(batch.record, batch.owner, **fields)
        batch.status, batch.started = "in_progress", True
        log.info("batch %s started: %d request(s)", batch.id, batch.total)

    def _drained(self, batch: _Batch) -> bool:
        """Nothing of the batch is left to read or inside the engine."""
        return batch.preparing is None and batch.lines is None and batch.held is None and not batch.in_engine

    def _next_line(self, batch: _Batch) -> BatchInputLine | None:
        """The next unanswered line of the input (``None`` at its end); after an error reading it, a retry goes on
        from where it was."""
        assert batch.lines is not None
        try:
            line = next(batch.lines, None)
        except Exception:
            batch.lines = self._unanswered(batch)  # a new pass skips every line already taken
            raise
        if line is None:
            batch.lines = None
        return line

    def _answer_expired(self, batch: _Batch) -> None:
        deadline = time.monotonic() + SLICE_S
        while batch.lines is not None and time.monotonic() <= deadline:
            if (line := self._next_line(batch)) is not None:
                self._answer(batch, _expired_line(line.custom_id), sequences_of(line.body))

    def _write(self, batch: _Batch, *, sync: bool) -> None:
        """Append what is answered; fsync when due (or ``sync``), and only then count it done and publish."""
        while batch.unwritten:
            answer = batch.unwritten[0]
            answer.file.append(answer.data)
            answer.end = answer.file.size
            batch.unsynced.append(batch.unwritten.popleft())
        # ``sync`` (before a batch finishes) also checks its files with nothing new in them: deleted, cut short?
        if sync or (batch.unsynced and time.monotonic() - batch.synced_at >= self.flush_interval_s):
            self._sync(batch)
        if not batch.published:
            self.store.update(batch.id, **batch.tally.counters())
            batch.published = True

    def _sync(self, batch: _Batch) -> None:
        failure: Exception | None = None
        for file in batch.files():
            try:
                file.sync()
            except (OSError, ResultsLost) as exc:
                failure = failure or exc
        durable = [answer for answer in batch.unsynced if answer.end <= answer.file.synced_size]
        lost = [answer for answer in batch.unsynced if answer.end > answer.file.synced_size]
        for answer in durable:
            batch.tally.add(answer.line)
        batch.unsynced = []
        batch.unwritten.extendleft(reversed(lost))  # cut back from the file: appended again, in order
        batch.published = batch.published and not durable
        batch.synced_at = time.monotonic()
        if failure is not None:
            raise failure

    def _move(self, batch: _Batch, status: str, **fields: object) -> None:
        lifecycle.check(batch.status, status)
        self.store.update(batch.id, status=status, **{lifecycle.timestamp_column(status): _now()}, **fields)
        batch.status = status

    def _finish(self, batch: _Batch, status: str, **fields: object) -> None:
        if status == "completed" and batch.status == "in_progress":
            self._move(batch, "finalizing")
        lifecycle.check(batch.status, status)
        final = {"status": status, lifecycle.timestamp_column(status): _now(), **batch.tally.counters(), **fields}
        self.store.finish(batch.record, **final)
        for file in batch.files():
            file.close()
        self._forget(batch)
        log.info(
            "batch %s %s (%d completed, %d failed) in %.0f s",
            batch.id,
            status,
            batch.tally.completed,
            batch.tally.failed,
            time.time() - batch.record.created_at,
        )

    def _forget(self, batch: _Batch) -> None:
        del self._batches[batch.id]
        self._turns.remove(batch.owner, batch)
        if self._waiting_for_room is batch:
            self._waiting_for_room = None

    def _trouble(self, batch: _Batch, exc: Exception) -> None:
        """A storage fault pauses the batch until the disk recovers; anything else is a bug that fails it."""
        reason = storage_fault(exc)
        if reason is None:
            self._fail(batch, exc)
        else:
            self._pause(batch, reason)

    def _pause(self, batch: _Batch, reason: str) -> None:
        if batch.fault is None:
            log.warning("batch %s paused by a storage fault (%s); retrying until it clears", batch.id, reason)
        batch.fault = reason
        batch.retry_at = time.monotonic() + batch.backoff
        batch.backoff = min(batch.backoff * 2, RETRY_MAX_S)

    def _fail(self, batch: _Batch, exc: Exception) -> None:
        """A bug, not the disk: fail the batch rather than retry it forever."""
        if batch.failure is not None:  # failing failed too: leave it for the next start
            log.exception("batch %s could not be failed; it is retried at the next start", batch.id, exc_info=exc)
            self._forget(batch)
            return
        log.exception("batch %s failed", batch.id, exc_info=exc)
        batch.failure = _describe(exc)
        self._stop(batch, "cancelled")
        batch.stopping = None
        self._advance_safely(batch)

    # ---- the engine's window ------------------------------------------------------------------------------------

    def _ready(self, batch: _Batch) -> bool:
        return (
            batch.status == "in_progress"
            and batch.stopping is None
            and batch.fault is None
            and batch.results is not None
            and (batch.held is not None or batch.lines is not None)
            and not batch.on_probation_hold
        )

    def _refill(self) -> None:
        """Put lines into the engine while there is room, one per turn; a line that does not fit keeps its turn."""
        submitted: list[EngineRequest] = []
        while self._in_engine < self.window:
            waiting, self._waiting_for_room = self._waiting_for_room, None
            if waiting is not None and self._ready(waiting):
                batch: _Batch | None = waiting
            else:
                batch = self._turns.next(self._ready, _running)
            if batch is None:
                break
            try:
                requests = self._take(batch)
            except Exception as exc:  # the input file could not be read: the batch's problem only
                self._trouble(batch, exc)
                continue
            if requests is None:
                self._waiting_for_room = batch
                break
            submitted += requests
        if submitted:
            self.engine.submit(submitted, self._on_result)

    def _take(self, batch: _Batch) -> list[EngineRequest] | None:
        """The engine requests of the batch's next line (none if it was answered at once), or ``None`` when it
        waits for room."""
        line, batch.held = batch.held, None
        if line is None:
            line = self._next_line(batch)
        if line is None:
            return []
        work = sequences_of(line.body)
        if self._in_engine and work <= self.serving.max_sequences and self._in_engine + work > self.window:
            batch.held = line
            return None
        request_id = new_request_id()
        key = (batch.id, line.custom_id)
        strikes = self.journal.strikes[key] if self.journal is not None else 0
        if strikes >= STRIKES_TO_QUARANTINE:
            log.error("batch %s: %s quarantined: the process died twice while it ran", batch.id, line.custom_id)
            message = "Quarantined: the server process died each of the two times this request ran; not run again."
            error = self.serving.error_line(
                line.custom_id, request_id=request_id, code="server_error", message=message, status_code=500
            )
            self._answer(batch, error, work)
            self._left_engine(batch, line.custom_id, answered=True)
            return []
        if strikes and self._probation is not None:
            batch.held, batch.on_probation_hold = line, True
            return []
        try:
            requests = self.serving.to_engine_requests(
                line.body, request_id=request_id, defaults=batch.defaults, group=batch.id
            )
        except Exception as exc:
            if storage_fault(exc) is not None:  # no descriptor left, say: the machine's, not the line's; it waits
                batch.held = line
                raise
            rejected = exc if isinstance(exc, RequestRejected) else _line_bug(batch, line, exc)
            error = self.serving.error_line(
                line.custom_id,
                request_id=request_id,
                code=rejected.code,
                message=rejected.message,
                param=rejected.param,
                status_code=rejected.status_code,
            )
            self._answer(batch, error, work)
            return []
        entry = _Request(batch, line, request_id, requests, [None] * len(requests), work)
        batch.in_engine[request_id] = entry
        if self.journal is not None:
            self.journal.entered(*key)
            if strikes:
                self._probation = key
        for index, request in enumerate(requests):
            self._requests[request.request_id] = (entry, index)
            self._in_engine += request.params.n
            batch.running += request.params.n
        return requests

    def _take_result(self, result: EngineResult) -> None:
        found = self._requests.pop(result.request_id, None)
        if found is None:
            return  # its batch was cancelled or expired, or the engine restarted and answered twice
        entry, index = found
        entry.results[index] = result
        self._in_engine -= entry.requests[index].params.n
        entry.batch.running -= entry.requests[index].params.n
        if any(r is None for r in entry.results):
            return
        batch = entry.batch
        del batch.in_engine[entry.request_id]
        results = [r for r in entry.results if r is not None]
        self._answer(batch, self.serving.output_line(entry.line, results, request_id=entry.request_id), entry.work)
        self._left_engine(batch, entry.line.custom_id, answered=True)

    def _left_engine(self, batch: _Batch, custom_id: str, *, answered: bool) -> None:
        if self.journal is None:
            return
        if answered:
            self.journal.answered(batch.id, custom_id)
        else:
            self.journal.dropped(batch.id, custom_id)
        if self._probation == (batch.id, custom_id):
            self._probation = None
            for other in self._batches.values():
                other.on_probation_hold = False

    def _answer(self, batch: _Batch, line: BatchOutputLine, work: int) -> None:
        assert batch.results is not None
        output, errors = batch.results
        batch.unwritten.append(_Answer(line, _encode(line) + b"\n", output if succeeded(line) else errors))
        batch.work -= work


def _running(batch: _Batch) -> int:
    return batch.running


def _line_bug(batch: _Batch, line: BatchInputLine, exc: Exception) -> RequestRejected:
    """A line the serving layer failed on other than by refusing it (a bug, or a body the validation let through):
    that line's 500, not the batch's failure."""
    log.error("batch %s: %s could not be turned into engine requests", batch.id, line.custom_id, exc_info=exc)
    return RequestRejected("server_error", "The server had an error while processing the request.", status_code=500)


def _run_task(task: Callable[[], None]) -> None:
    try:
        task()
    except Exception:  # a bug in one message must not stop the loop
        log.exception("a message to the batch loop failed")


def _now() -> int:
    return int(time.time())


def _expired_line(custom_id: str) -> BatchOutputLine:
    error = BatchLineError(
        code="batch_expired", message="This request could not be executed before the completion window expired."
    )
    return BatchOutputLine(id=new_line_id(), custom_id=custom_id, response=None, error=error)


def _describe(exc: Exception) -> str:
    """What went wrong, for the batch's ``errors``: a file error by its reason and the file's name (a file id), never
    the server's path; any other exception by its type and message (ours, with no path in them)."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {Path(exc.filename).name}" if isinstance(exc.filename, str) else exc.strerror
    return str(exc) if isinstance(exc, ResultsLost) else f"{type(exc).__name__}: {exc}"


def _internal_error(detail: str) -> BatchErrors:
    return BatchErrors(
        data=[BatchError(code="internal_error", message=f"The server could not run the batch: {detail}")]
    )
