"""The batch runner: validating -> in_progress -> finalizing -> completed (or failed; cancelling -> cancelled;
expired once the completion window has passed).

Three kinds of threads meet here, none of them the event loop:

- a *prepare* thread per batch validates the input file, turns each line into engine requests and submits them;
- the engine worker's thread reports each finished request (``_on_result`` only queues it);
- one *writer* thread turns finished requests into output/error lines, appends them at once, fsyncs and publishes the
  counts every ``flush_interval_s``, and finalizes batches whose last request finished.

The database holds the lifecycle; the results files hold the results. A batch found unfinished at startup is resumed:
every request that already has a line is skipped (see ``results.recover_tally``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec

from batchgen.schemas import (
    BatchError,
    BatchErrors,
    BatchInputLine,
    BatchLineError,
    BatchObject,
    BatchOutputLine,
    FileObject,
)
from batchgen.schemas.validation import LineError, iter_input_lines

from ..engine.request import EngineRequest, EngineResult
from ..ids import new_file_id, new_line_id, new_request_id
from ..serving import BatchDefaults, OpenAIServing, RequestRejected
from ..settings import Settings
from ..storage.blobs import BlobStore, ResultsFile
from ..storage.database import Database
from .results import Tally, recover_tally

log = logging.getLogger("batchgen.server.runner")

MAX_REPORTED_ERRORS = 100
SUBMIT_CHUNK = 256
_encode = msgspec.json.Encoder().encode


class Engine(Protocol):
    """What the runner needs of the engine worker."""

    def submit(self, requests: list[EngineRequest], on_result: Callable[[EngineResult], None]) -> None: ...

    def abort_group(self, group: str, on_aborted: Callable[[], None] | None = None) -> None: ...


@dataclass(slots=True)
class _Line:
    line: BatchInputLine
    expected: int
    results: list[EngineResult] = field(default_factory=list)


@dataclass(slots=True)
class _Active:
    """A batch whose requests are in the engine: its open results files and what is still outstanding."""

    batch_id: str
    output_file_id: str
    error_file_id: str
    output: ResultsFile
    errors: ResultsFile
    tally: Tally
    pending: dict[str, _Line] = field(default_factory=dict)
    expires_at: int | None = None
    custom_ids: list[str] = field(default_factory=list)
    """Of every request, in input order (an expired batch answers the unfinished ones)."""
    submitted: bool = False
    """All requests are in the engine (or answered); the batch finishes when ``pending`` empties."""
    stop_reason: str | None = None
    """``cancelled`` or ``expired`` once asked to stop: no more requests go to the engine."""
    stopped: bool = False
    """The engine has dropped the batch's requests; no result of it will come any more."""
    dirty: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Stopped(msgspec.Struct, frozen=True):
    batch_id: str


class _Check(msgspec.Struct, frozen=True):
    """Wake the writer to see whether a batch can finish."""

    batch_id: str


class BatchRunner:
    def __init__(
        self,
        *,
        settings: Settings,
        db: Database,
        blobs: BlobStore,
        serving: OpenAIServing,
        engine: Engine,
        on_finished: Callable[[BatchObject], None] | None = None,
    ) -> None:
        self.settings = settings
        self.on_finished = on_finished
        """Told each batch that reached a terminal state (completion callbacks); called from the runner's threads."""
        self.db = db
        self.blobs = blobs
        self.serving = serving
        self.engine = engine
        self._active: dict[str, _Active] = {}
        self._cancel_requested: set[str] = set()
        self._lock = threading.Lock()
        self._inbox: queue.SimpleQueue[EngineResult | _Stopped | _Check | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="batchgen-writer", daemon=True)
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- called from the event loop -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._writer.start()
        for batch in self.db.batches_with_status(("validating", "in_progress", "finalizing", "cancelling")):
            self.launch(batch)

    def launch(self, batch: BatchObject) -> None:
        """Run (or resume) a batch in the background."""
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self, batch_id: str) -> None:
        """The batch is already ``cancelling`` in the database; stop its requests at the next engine step."""
        with self._lock:
            self._cancel_requested.add(batch_id)
            active = self._active.get(batch_id)
        if active is not None:
            self._stop(active, "cancelled")

    async def stop(self) -> None:
        """Stop writing (results not yet written are resubmitted on the next start)."""
        for task in list(self._tasks):
            task.cancel()
        self._inbox.put(None)
        await asyncio.to_thread(self._writer.join, 30)

    async def _run(self, batch: BatchObject) -> None:
        try:
            await asyncio.to_thread(self._prepare, batch)
        except Exception as exc:
            log.exception("batch %s failed", batch.id)
            with self._lock:
                active = self._active.pop(batch.id, None)
            if active is not None:
                self.engine.abort_group(batch.id)
            error = BatchError(code="internal_error", message=f"The server could not run the batch: {exc}")
            self.db.update_batch(batch.id, status="failed", failed_at=_now(), errors=BatchErrors(data=[error]))
            self._finished(batch.id)

    # ---- prepare thread -----------------------------------------------------------------------------------------

    def _prepare(self, batch: BatchObject) -> None:
        if batch.status == "finalizing":  # every result was durable before finalizing began: publish them
            counters = recover_tally(self._results_paths(batch)).counters()
            files = (batch.id, batch.output_file_id, batch.error_file_id)
            self._publish(*files, status="completed", completed_at=_now(), **counters)
            return
        if batch.status == "validating":
            lines = self._validate(batch)
            if lines is None or self._expire_before_start(batch):
                return
            batch = self._start(batch, len(lines))
        else:  # resuming after a restart: the file was valid when the batch started
            lines = [line for line in self._read_lines(batch) if isinstance(line, BatchInputLine)]
        if batch.output_file_id is None or batch.error_file_id is None:  # cancelled before it started
            self._finish_cancelled_before_start(batch)
            return
        tally = recover_tally(self._results_paths(batch))
        active = _Active(
            batch_id=batch.id,
            output_file_id=batch.output_file_id,
            error_file_id=batch.error_file_id,
            output=self.blobs.open_results(batch.output_file_id),
            errors=self.blobs.open_results(batch.error_file_id),
            tally=tally,
            expires_at=batch.expires_at,
            custom_ids=[line.custom_id for line in lines],
            dirty=True,
        )
        with self._lock:
            self._active[batch.id] = active
        if batch.status == "cancelling" or self._is_cancelling(batch.id):
            self._stop(active, "cancelled")
        self._submit(batch, active, [line for line in lines if line.custom_id not in tally.done])

    def _results_paths(self, batch: BatchObject) -> list[Path]:
        return [self.blobs.path(file_id) for file_id in (batch.output_file_id, batch.error_file_id) if file_id]

    def _read_lines(self, batch: BatchObject) -> list[BatchInputLine | LineError]:
        path, limits = self.blobs.path(batch.input_file_id), self.settings.validation_limits
        return list(iter_input_lines(path, endpoint=batch.endpoint, limits=limits))

    def _validate(self, batch: BatchObject) -> list[BatchInputLine] | None:
        """The requests of a valid file; ``None`` after failing the batch with the errors found."""
        items = self._read_lines(batch)
        errors = [item.to_batch_error() for item in items if isinstance(item, LineError)]
        if not errors:
            return [item for item in items if isinstance(item, BatchInputLine)]
        failed = self.db.update_batch(
            batch.id,
            only_if_status=("validating",),
            status="failed",
            failed_at=_now(),
            total=0,
            errors=BatchErrors(data=errors[:MAX_REPORTED_ERRORS]),
        )
        if failed:
            self._finished(batch.id)
        else:  # cancelled while validating
            self._finish_cancelled_before_start(batch)
        return None

    def _start(self, batch: BatchObject, total: int) -> BatchObject:
        """validating -> in_progress, with empty results files that a reader can follow while the batch runs."""
        created_at = _now()
        output_file, error_file = (
            FileObject(
                id=new_file_id(),
                bytes=0,
                created_at=created_at,
                filename=f"{batch.id}_{kind}.jsonl",
                purpose="batch_output",
                status="uploaded",
            )
            for kind in ("output", "error")
        )
        owner = self.db.owner_of_batch(batch.id)
        for file in (output_file, error_file):
            self.blobs.path(file.id).touch()
            self.db.insert_file(file, owner=owner)
        started = self.db.update_batch(
            batch.id,
            only_if_status=("validating",),
            status="in_progress",
            in_progress_at=created_at,
            total=total,
            output_file_id=output_file.id,
            error_file_id=error_file.id,
        )
        if not started:  # cancelled while validating
            for file in (output_file, error_file):
                self.db.delete_file(file.id)
                self.blobs.delete(file.id)
        current = self.db.get_batch(batch.id, owner=None)
        assert current is not None
        return current

    def _submit(self, batch: BatchObject, active: _Active, lines: list[BatchInputLine]) -> None:
        defaults = BatchDefaults.of(batch)
        chunk: list[EngineRequest] = []
        for line in lines:
            if active.stop_reason is not None:
                break
            request_id = new_request_id()
            try:
                requests = self.serving.to_engine_requests(
                    line, request_id=request_id, defaults=defaults, group=batch.id
                )
            except RequestRejected as exc:
                rejected = self.serving.error_line(
                    line.custom_id, request_id=request_id, code=exc.code, message=exc.message, param=exc.param
                )
                self._record(active, rejected)
                continue
            with active.lock:
                active.pending[request_id] = _Line(line, expected=len(requests))
            chunk += requests
            if len(chunk) >= SUBMIT_CHUNK:
                self.engine.submit(chunk, self._on_result)
                chunk = []
        if chunk:
            self.engine.submit(chunk, self._on_result)
        with active.lock:
            active.submitted = True
        if active.stop_reason is not None:
            self._abort(batch.id)  # again: requests may have gone in after the stop arrived
        else:
            self._inbox.put(_Check(batch.id))  # finishes at once if nothing was left to run

    def _stop(self, active: _Active, reason: str) -> None:
        """Cancel or expire: submit nothing more, drop what the engine holds, then finish the batch."""
        with active.lock:
            if active.stop_reason is not None:
                return
            active.stop_reason = reason
        self._abort(active.batch_id)

    def _abort(self, batch_id: str) -> None:
        """Stop the batch's requests at the next engine step, then let the writer finish the batch.

        Once the engine has applied the abort no result of the batch's requests submitted so far can arrive, so the
        writer can finish the batch when ``_Stopped`` reaches it (after every result that came before).
        """
        self.engine.abort_group(batch_id, lambda: self._inbox.put(_Stopped(batch_id)))

    def _expire_before_start(self, batch: BatchObject) -> bool:
        """A batch whose window passed while it waited or validated expires without running."""
        if batch.expires_at is None or time.time() < batch.expires_at:
            return False
        expired = self.db.update_batch(batch.id, only_if_status=("validating",), status="expired", expired_at=_now())
        if expired:
            self._finished(batch.id)
        return expired

    def _is_cancelling(self, batch_id: str) -> bool:
        with self._lock:
            return batch_id in self._cancel_requested

    def _finish_cancelled_before_start(self, batch: BatchObject) -> None:
        if self.db.update_batch(batch.id, only_if_status=("cancelling",), status="cancelled", cancelled_at=_now()):
            self._finished(batch.id)
        with self._lock:
            self._cancel_requested.discard(batch.id)

    def _finished(self, batch_id: str) -> None:
        """Hand the batch, now in its terminal state, to ``on_finished``."""
        if self.on_finished is None:
            return
        batch = self.db.get_batch(batch_id, owner=None)
        if batch is not None:
            self.on_finished(batch)

    # ---- engine thread ------------------------------------------------------------------------------------------

    def _on_result(self, result: EngineResult) -> None:
        self._inbox.put(result)

    # ---- writer thread ------------------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        interval = min(self.settings.flush_interval_s, 1.0)
        last_flush = time.monotonic()
        while True:
            try:
                item = self._inbox.get(timeout=interval)
            except queue.Empty:
                item = _Check("")
            if item is None:
                break
            try:
                self._handle(item)
                if time.monotonic() - last_flush >= interval:
                    self._flush()
                    self._expire_due()
                    last_flush = time.monotonic()
            except Exception:
                log.exception("writer failed on %r", item)
        self._flush()

    def _handle(self, item: EngineResult | _Stopped | _Check) -> None:
        if isinstance(item, EngineResult):
            self._handle_result(item)
            return
        with self._lock:
            active = self._active.get(item.batch_id)
        if active is None:
            return
        if isinstance(item, _Stopped):
            active.stopped = True
        if active.stopped or (active.submitted and not active.pending):
            self._finish(active)

    def _handle_result(self, result: EngineResult) -> None:
        with self._lock:
            active = self._active.get(result.group)
        if active is None or active.stopped:
            return  # a late result of a batch already finished, cancelled or expired
        request_id = result.request_id.rsplit("#", 1)[0]
        with active.lock:
            entry = active.pending.get(request_id)
            if entry is None:
                return
            entry.results.append(result)
            if len(entry.results) < entry.expected:
                return
            del active.pending[request_id]
        self._record(active, self.serving.output_line(entry.line, entry.results, request_id=request_id))
        if active.submitted and not active.pending:
            self._finish(active)

    def _record(self, active: _Active, line: BatchOutputLine) -> None:
        ok = line.response is not None and line.response.status_code == 200 and line.error is None
        data = _encode(line) + b"\n"
        with active.lock:
            (active.output if ok else active.errors).append(data)
            active.tally.add(line)
            active.dirty = True

    def _expire_due(self) -> None:
        now = time.time()
        with self._lock:
            due = [a for a in self._active.values() if a.expires_at is not None and now >= a.expires_at]
        for active in due:
            self._stop(active, "expired")

    def _flush(self) -> None:
        with self._lock:
            actives = list(self._active.values())
        for active in actives:
            self._sync(active)

    def _sync(self, active: _Active) -> None:
        """Results on disk first, then the counts that describe them: a count never exceeds what is durable."""
        with active.lock:
            if not active.dirty:
                return
            active.output.sync()
            active.errors.sync()
            active.dirty = False
            counters = active.tally.counters()
        self.db.update_batch(active.batch_id, **counters)

    def _finish(self, active: _Active) -> None:
        with self._lock:
            if self._active.pop(active.batch_id, None) is None:
                return
            self._cancel_requested.discard(active.batch_id)
        if active.stopped and active.stop_reason == "expired":
            for custom_id in active.custom_ids:
                if custom_id not in active.tally.done:
                    self._record(active, _expired_line(custom_id))
        self._sync(active)
        active.output.close()
        active.errors.close()
        files = (active.batch_id, active.output_file_id, active.error_file_id)
        if active.stopped:
            reason = active.stop_reason  # "cancelled" or "expired": the status and its timestamp column
            self._publish(*files, status=reason, **{f"{reason}_at": _now()})
            return
        self.db.update_batch(active.batch_id, status="finalizing", finalizing_at=_now())
        self._publish(*files, status="completed", completed_at=_now())

    def _publish(self, batch_id: str, output_file_id: str | None, error_file_id: str | None, **final: object) -> None:
        """The results files become final and the batch takes its final ``status``, dropping an empty file.

        The batch's new fields and the dropped files' rows change in one transaction, so a crash leaves either the
        unfinished batch (resumed at startup, which publishes again) or the finished one, never a half of each.
        """
        empty: dict[str, str] = {}
        for column, file_id in (("output_file_id", output_file_id), ("error_file_id", error_file_id)):
            if file_id is None:
                continue
            size = self.blobs.size(file_id)
            if size == 0:
                empty[column] = file_id
            else:
                self.db.update_file(file_id, status="processed", bytes=size, checksum=self.blobs.checksum(file_id))
        self.db.finish_batch(batch_id, drop_files=list(empty.values()), **dict.fromkeys(empty), **final)
        for file_id in empty.values():
            self.blobs.delete(file_id)
        self._finished(batch_id)


def _now() -> int:
    return int(time.time())


def _expired_line(custom_id: str) -> BatchOutputLine:
    error = BatchLineError(
        code="batch_expired", message="This request could not be executed before the completion window expired."
    )
    return BatchOutputLine(id=new_line_id(), custom_id=custom_id, response=None, error=error)
