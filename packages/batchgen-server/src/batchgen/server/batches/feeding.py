"""Feeding the engine: whose line goes in next, and the window it goes into.

The engine holds at most ``window`` sequences of all batches together; a line being tokenized holds its place as if
it were inside. A free place goes to the batch the turns name (``Turns``: the tenant, then its batch, with the fewest
sequences in the window), and a line that does not fit the room left keeps its turn. Each line taken is tokenized off
the loop's thread (``Tokenizer``), then submitted; its results find it through a map keyed by engine request id, and
a result whose id is no longer there (its batch was cancelled or expired) is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from batchgen.schemas import BatchInputLine, BatchOutputLine, sequences_of

from ..engine.interface import EngineSubmitter
from ..engine.request import EngineResult
from ..ids import new_request_id
from ..serving import OpenAIServing, PreparedRequest, RequestRejected, error_line
from ..storage.faults import storage_fault
from .inputs import InputReader
from .quarantine import Quarantine
from .state import Batch, Entry
from .tokenizing import Outcome, Tokenizer
from .turns import Turns
from .writer import ResultsWriter

log = logging.getLogger("batchgen.server.loop")


class Feeder:
    def __init__(
        self,
        serving: OpenAIServing,
        engine: EngineSubmitter,
        window: int,
        *,
        inputs: InputReader,
        writer: ResultsWriter,
        quarantine: Quarantine,
        tokenizer: Tokenizer,
        post: Callable[[Callable[[], None]], None],
        trouble: Callable[[Batch, Exception], None],
    ) -> None:
        """``post`` hands a message to the loop's thread; ``trouble`` is the loop's answer to a batch's exception."""
        self.serving = serving
        self.engine = engine
        self.window = window
        """Most sequences of all batches in the engine (running or queued there) or being tokenized for it."""
        self.inputs = inputs
        self.writer = writer
        self.quarantine = quarantine
        self.tokenizer = tokenizer
        self._post = post
        self._trouble = trouble
        self._turns: Turns[Batch] = Turns()
        self._waiting_for_room: Batch | None = None
        self._requests: dict[str, tuple[Entry, int]] = {}
        """Engine request id -> its line and its index there, while its result is awaited."""
        self._inside = 0
        """Sequences in the window."""
        self._unsent: list[Entry] = []
        """Lines tokenized since the last refill, submitted together."""

    def add(self, batch: Batch) -> None:
        self._turns.add(batch.owner, batch)

    def remove(self, batch: Batch) -> None:
        self._turns.remove(batch.owner, batch)
        if self._waiting_for_room is batch:
            self._waiting_for_room = None

    def refill(self) -> None:
        """Take lines into the window while there is room, one per turn, then submit those tokenized."""
        while self._inside < self.window:
            waiting, self._waiting_for_room = self._waiting_for_room, None
            if waiting is not None and self._ready(waiting):
                batch: Batch | None = waiting
            else:
                batch = self._turns.next(self._ready, _running)
            if batch is None:
                break
            try:
                fits = self._take(batch)
            except Exception as exc:  # the input file could not be read: the batch's problem only
                self._trouble(batch, exc)
                continue
            if not fits:
                self._waiting_for_room = batch
                break
        if self._unsent:
            sending, self._unsent = self._unsent, []
            for entry in sending:
                self.quarantine.entered(entry.batch.id, entry.line.custom_id)
            try:
                self.engine.submit([request for entry in sending for request in entry.requests], self._on_result)
            except Exception as exc:  # the engine refused them all (a bug): their lines are answered, never stranded
                for entry in sending:
                    self._fail(entry, _line_bug(entry.batch, entry.line, exc))

    def drop(self, batch: Batch) -> list[BatchInputLine]:
        """Take the batch out of the window: abort what the engine runs of it, forget what is tokenized for it, and
        hand back every line it took and has not answered (those in the window, then those held)."""
        entries = list(batch.in_window.values())
        ids = [request.request_id for entry in entries for request in entry.requests]
        for request_id in ids:
            self._requests.pop(request_id, None)
        self._unsent = [entry for entry in self._unsent if entry.batch is not batch]
        for entry in entries:
            self._release(entry)
            self.quarantine.left(batch.id, entry.line.custom_id, answered=False)
        if ids:
            self.engine.abort(ids)
        lines = [entry.line for entry in entries] + list(batch.held)
        batch.held.clear()
        return lines

    def _ready(self, batch: Batch) -> bool:
        return (
            batch.status == "in_progress"
            and batch.stopping is None
            and batch.fault is None
            and batch.results is not None
            and not self.tokenizer.fetching_full(batch.owner)  # its tenant's slow pictures hold no more places
            and (
                not self.quarantine.waits(batch.id, batch.held[0].custom_id) if batch.held else batch.lines is not None
            )
        )

    def _take(self, batch: Batch) -> bool:
        """Take the batch's next line into the window to be tokenized (or answer it at once); ``False`` when it waits
        for room."""
        line = batch.held.popleft() if batch.held else self.inputs.next_line(batch)
        if line is None:
            return True
        work = sequences_of(line.body)
        if self._inside and work <= self.serving.preparer.max_sequences and self._inside + work > self.window:
            batch.held.appendleft(line)
            return False
        request_id = new_request_id()
        if self.quarantine.quarantined(batch.id, line.custom_id):
            log.error("batch %s: %s quarantined: the process died twice while it ran", batch.id, line.custom_id)
            message = "Quarantined: the server process died each of the two times this request ran; not run again."
            error = error_line(
                line.custom_id, request_id=request_id, code="server_error", message=message, status_code=500
            )
            self._answer(batch, line, error, work)
            return True
        if self.quarantine.waits(batch.id, line.custom_id):
            batch.held.appendleft(line)
            return True
        self.quarantine.taken(batch.id, line.custom_id)
        entry = Entry(batch, line, request_id, work)
        batch.in_window[request_id] = entry
        self._hold(entry, work)
        done = partial(self._tokenized, entry)
        self.tokenizer.put(line.body, request_id=request_id, defaults=batch.defaults, done=done, owner=batch.owner)
        return True

    def _tokenized(self, entry: Entry, outcome: Outcome) -> None:
        batch = entry.batch
        if batch.in_window.get(entry.request_id) is not entry:
            return  # its batch was stopped, or a storage fault sent the line back to be tokenized again
        if isinstance(outcome, PreparedRequest):
            entry.prepared, entry.results = outcome, [None] * len(outcome.requests)
            self._hold(entry, sum(request.params.n for request in outcome.requests) - entry.inside)
            for index, request in enumerate(outcome.requests):
                self._requests[request.request_id] = (entry, index)
            self._unsent.append(entry)
            return
        if storage_fault(outcome) is not None:  # no descriptor left, say: the machine's, not the line's; it waits
            self._send_back(batch)
            self._trouble(batch, outcome)
            return
        self._fail(entry, outcome if isinstance(outcome, RequestRejected) else _line_bug(batch, entry.line, outcome))

    def _fail(self, entry: Entry, rejected: RequestRejected) -> None:
        """Answer the entry's line with an error line; none of its requests is awaited any more."""
        for request in entry.requests:
            self._requests.pop(request.request_id, None)
        error = error_line(
            entry.line.custom_id,
            request_id=entry.request_id,
            code=rejected.code,
            message=rejected.message,
            param=rejected.param,
            status_code=rejected.status_code,
        )
        self._release(entry)
        self._answer(entry.batch, entry.line, error, entry.work)

    def _send_back(self, batch: Batch) -> None:
        """Put every line of the batch being tokenized back in front of its held lines, in input order, so that none
        reaches the engine ahead of the one a storage fault held back."""
        back = [entry for entry in batch.in_window.values() if entry.prepared is None]
        for entry in back:
            self._release(entry)
            self.quarantine.left(batch.id, entry.line.custom_id, answered=False)
        batch.held.extendleft(reversed([entry.line for entry in back]))

    def _on_result(self, result: EngineResult) -> None:
        self._post(partial(self._take_result, result))

    def _take_result(self, result: EngineResult) -> None:
        found = self._requests.pop(result.request_id, None)
        if found is None:
            return  # its batch was cancelled or expired, or the engine restarted and answered twice
        entry, index = found
        assert entry.prepared is not None
        entry.results[index] = result
        self._hold(entry, -entry.requests[index].params.n)
        if any(r is None for r in entry.results):
            return
        self._release(entry)
        results = [r for r in entry.results if r is not None]
        output = self.serving.output_line(entry.line.custom_id, entry.prepared, results)
        self._answer(entry.batch, entry.line, output, entry.work)

    def _answer(self, batch: Batch, line: BatchInputLine, answer: BatchOutputLine, work: int) -> None:
        self.writer.answer(batch, answer, work)
        self.quarantine.left(batch.id, line.custom_id, answered=True)

    def _release(self, entry: Entry) -> None:
        """The entry leaves the window, with whatever place it still held there."""
        del entry.batch.in_window[entry.request_id]
        self._hold(entry, -entry.inside)

    def _hold(self, entry: Entry, sequences: int) -> None:
        """Count ``sequences`` more of the entry in the window (fewer, when negative)."""
        entry.inside += sequences
        entry.batch.running += sequences
        self._inside += sequences


def _running(batch: Batch) -> int:
    return batch.running


def _line_bug(batch: Batch, line: BatchInputLine, exc: Exception) -> RequestRejected:
    """A line the serving layer failed on other than by refusing it (a bug, or a body the validation let through):
    that line's 500, not the batch's failure."""
    log.error("batch %s: %s could not be turned into engine requests", batch.id, line.custom_id, exc_info=exc)
    return RequestRejected("server_error", "The server had an error while processing the request.", status_code=500)
