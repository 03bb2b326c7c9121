"""The batch loop: one thread owns every batch from its admission to its final status.

The API (admit, cancel), the engine (each finished request) and the clock only post messages to it; every change to
a batch happens here, one at a time, so no state is shared and nothing is locked.
Per batch the loop

1. prepares: reads back the results files of a batch resumed after a restart (the files are the truth), then makes
   one streaming pass over the input file that validates it and counts its work in sequences (prompts x n);
2. runs: a second streaming pass feeds the engine a line at a time while fewer than ``window`` sequences of all
   batches are inside it (``feeding``: turns, the window; each line tokenized off this thread, in ``tokenizing``;
   struck lines held back by ``quarantine``), so a small batch finishes promptly behind a huge one, and memory stays
   flat whatever the file's size;
3. writes: each finished request becomes one output or error line (``writer``), appended whole at once and fsynced
   every ``flush_interval_s``; only then does it count as done (and the live counts get published);
4. finishes: ``finalizing`` -> ``completed`` once every line is durable, or ``cancelled``, ``expired``, ``failed``,
   each move checked against the one table in ``lifecycle``.

A storage fault (a full disk, an I/O error) pauses the batch it hit: its unwritten lines wait in memory, it takes no
new work, and the loop retries with backoff until the disk recovers, then resumes by itself.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

from batchgen.schemas import BatchError, BatchErrors, BatchLineError, BatchObject, BatchOutputLine, sequences_of
from batchgen.schemas.validation import DEFAULT_LIMITS, ValidationLimits

from ..engine.interface import EngineSubmitter
from ..ids import new_line_id
from ..serving import BatchDefaults, OpenAIServing
from ..storage.blobs import ResultsLost
from ..storage.faults import storage_fault
from . import lifecycle
from .crashes import CrashJournal
from .feeding import Feeder
from .inputs import InputReader
from .quarantine import Quarantine
from .state import RETRY_FIRST_S, RETRY_MAX_S, Batch
from .stores import Store
from .tokenizing import Tokenizer
from .writer import ResultsWriter

log = logging.getLogger("batchgen.server.loop")

SLICE_S = 0.02
"""The longest the loop reads one batch's files (preparing, expiring) before it looks at its messages again."""
TICK_S = 0.25
"""How often an idle loop with unfinished batches wakes: fsyncs due, retries due, completion windows."""
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
        """``journal`` notes what is inside the engine, so that a line that kills the process is pinned and
        quarantined (none in run-batch)."""
        self.store = store
        self.capacity = capacity
        self.status = LoopStatus()
        """A snapshot for the API, replaced (never mutated) after every round."""
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="batchgen-loop", daemon=True)
        self._stopped = False
        self._batches: dict[str, Batch] = {}
        self._next_expiry_check = 0.0
        self._inputs = InputReader(store, limits, serving.served_names)
        self._writer = ResultsWriter(store, flush_interval_s)
        self._quarantine = Quarantine(journal)
        self._tokenizer = Tokenizer(serving, self._inbox.put)
        self._feeder = Feeder(
            serving,
            engine,
            window,
            inputs=self._inputs,
            writer=self._writer,
            quarantine=self._quarantine,
            tokenizer=self._tokenizer,
            post=self._inbox.put,
            trouble=self._trouble,
        )

    # ---- posted from other threads ------------------------------------------------------------------------------

    def start(self) -> None:
        self._tokenizer.start()
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Write and fsync what is answered, then stop (what is not answered yet resumes at the next start)."""
        self._stopped = True
        self._inbox.put(None)
        self._thread.join(timeout)

    def admit(
        self, batch: BatchObject, owner: str, sequences: int, output_expiry_s: int | None = None
    ) -> Future[BatchObject]:
        """Record a new ``validating`` batch and run it, unless its ``sequences`` exceed the free capacity
        (``CapacityExceeded``); its results files expire ``output_expiry_s`` after they are created."""
        return self._ask(partial(self._admit, batch, owner, sequences, output_expiry_s))

    def cancel(self, batch_id: str, owner: str) -> Future[BatchObject | None]:
        """Cancel the batch if it can be; the batch as it now is (``None`` if ``owner`` has no such batch)."""
        return self._ask(partial(self._cancel, batch_id, owner))

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
        self._feeder.refill()
        fault = next((batch.fault for batch in self._batches.values() if batch.fault), None)
        queued = sum(batch.work for batch in self._batches.values())
        self.status = LoopStatus(queued, len(self._batches), fault)

    def _close(self) -> None:
        self._tokenizer.stop()  # what it had not tokenized runs again at the next start
        while True:  # answer what was asked before the stop
            try:
                task = self._inbox.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                _run_task(task)
        for batch in self._batches.values():
            try:
                self._writer.write(batch, sync=True)
            except Exception as exc:
                log.warning("batch %s: unwritten results dropped at shutdown (%s); they run again", batch.id, exc)
            self._writer.close(batch)
        self._quarantine.close()

    # ---- admission and cancellation -----------------------------------------------------------------------------

    def _admit(
        self,
        batch: BatchObject,
        owner: str,
        sequences: int,
        output_expiry_s: int | None,
        reply: Future[BatchObject],
    ) -> None:
        try:
            queued = sum(tracked.work for tracked in self._batches.values())
            if queued + sequences > self.capacity:
                raise CapacityExceeded(sequences, queued, self.capacity)
            self.store.insert(batch, owner, output_expiry_s)
            self._track(batch, owner, sequences)
        except Exception as exc:
            reply.set_exception(exc)
        else:
            log.info("batch %s created: %d sequence(s)", batch.id, sequences)
            reply.set_result(batch)

    def _track(self, record: BatchObject, owner: str, work: int) -> None:
        batch = Batch(record, owner, record.status, work, BatchDefaults.of(record), record.status != "validating")
        batch.total = record.request_counts.total  # counted again while preparing, unless it is finalizing
        batch.preparing = self._inputs.prepare(batch)
        if batch.status == "cancelling":
            batch.stopping = "cancelled"
        self._batches[batch.id] = batch
        self._feeder.add(batch)

    def _cancel(self, batch_id: str, owner: str, reply: Future[BatchObject | None]) -> None:
        try:
            batch = self._batches.get(batch_id)
            if batch is not None and batch.owner == owner and batch.status in lifecycle.CANCELLABLE:
                self._move(batch, "cancelling")
                self._stop(batch, "cancelled")
            reply.set_result(self.store.get(batch_id, owner))
        except Exception as exc:
            reply.set_exception(exc)

    def _stop(self, batch: Batch, reason: str) -> None:
        """Take no more work for the batch and drop what the engine holds of it (or tokenizes for it); an expired
        batch answers every request not done with ``batch_expired``."""
        batch.stopping = reason
        if not batch.started:
            batch.preparing = None
        unanswered = self._feeder.drop(batch)
        if reason == "expired":
            for line in unanswered:
                self._writer.answer(batch, _expired_line(line.custom_id), sequences_of(line.body))
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

    def _advance_safely(self, batch: Batch) -> None:
        try:
            self._advance(batch)
        except Exception as exc:
            self._trouble(batch, exc)
            return
        if batch.fault is not None:
            log.warning("batch %s: storage recovered; resuming", batch.id)
            batch.fault, batch.backoff = None, RETRY_FIRST_S

    def _advance(self, batch: Batch) -> None:
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
                batch.preparing = self._inputs.prepare(batch)  # a retry starts over
                raise
            batch.preparing = None
            batch.taken = set(batch.tally.done)
            if batch.status in ("validating", "in_progress") and not batch.errors:
                batch.lines = self._inputs.unanswered(batch)
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
        self._writer.write(batch, sync=drained or batch.stopping is not None)
        if not drained or batch.unwritten or batch.unsynced or not batch.published:
            return
        missing = batch.total - len(batch.tally.done)
        if batch.stopping is None and missing > 0:  # ``completed`` only with a line for every custom_id
            raise RuntimeError(f"{missing} request(s) have no line after the input was drained")
        self._finish(batch, batch.stopping or "completed")

    def _start(self, batch: Batch) -> None:
        """validating -> in_progress, with empty results files that a reader can follow while the batch runs."""
        lifecycle.check(batch.status, "in_progress")
        fields = {"status": "in_progress", "in_progress_at": _now(), "total": batch.total}
        batch.record = self.store.start(batch.record, batch.owner, **fields)
        batch.status, batch.started = "in_progress", True
        log.info("batch %s started: %d request(s)", batch.id, batch.total)

    def _drained(self, batch: Batch) -> bool:
        """Nothing of the batch is left to read, tokenize or run."""
        return batch.preparing is None and batch.lines is None and not batch.held and not batch.in_window

    def _answer_expired(self, batch: Batch) -> None:
        deadline = time.monotonic() + SLICE_S
        while batch.lines is not None and time.monotonic() <= deadline:
            if (line := self._inputs.next_line(batch)) is not None:
                self._writer.answer(batch, _expired_line(line.custom_id), sequences_of(line.body))

    def _move(self, batch: Batch, status: str, **fields: object) -> None:
        lifecycle.check(batch.status, status)
        self.store.update(batch.id, status=status, **{lifecycle.timestamp_column(status): _now()}, **fields)
        batch.status = status

    def _finish(self, batch: Batch, status: str, **fields: object) -> None:
        if status == "completed" and batch.status == "in_progress":
            self._move(batch, "finalizing")
        lifecycle.check(batch.status, status)
        final = {"status": status, lifecycle.timestamp_column(status): _now(), **batch.tally.counters(), **fields}
        self.store.finish(batch.record, **final)
        self._writer.close(batch)
        self._forget(batch)
        log.info(
            "batch %s %s (%d completed, %d failed) in %.0f s",
            batch.id,
            status,
            batch.tally.completed,
            batch.tally.failed,
            time.time() - batch.record.created_at,
        )

    def _forget(self, batch: Batch) -> None:
        del self._batches[batch.id]
        self._feeder.remove(batch)

    def _trouble(self, batch: Batch, exc: Exception) -> None:
        """A storage fault pauses the batch until the disk recovers; anything else is a bug that fails it."""
        reason = storage_fault(exc)
        if reason is None:
            self._fail(batch, exc)
        else:
            self._pause(batch, reason)

    def _pause(self, batch: Batch, reason: str) -> None:
        if batch.fault is None:
            log.warning("batch %s paused by a storage fault (%s); retrying until it clears", batch.id, reason)
        batch.fault = reason
        batch.retry_at = time.monotonic() + batch.backoff
        batch.backoff = min(batch.backoff * 2, RETRY_MAX_S)

    def _fail(self, batch: Batch, exc: Exception) -> None:
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
