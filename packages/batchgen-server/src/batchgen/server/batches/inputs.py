"""The streaming passes over a batch's input file: one to prepare the batch (read back what it wrote, validate and
count), then one to hand out its unanswered lines. Neither holds more than a line in memory."""

from __future__ import annotations

from collections.abc import Container, Iterator

from batchgen.schemas import BatchInputLine, sequences_of
from batchgen.schemas.validation import LineError, ValidationLimits, iter_input_lines

from .results import Tally, recover
from .state import Batch
from .stores import Store

MAX_REPORTED_ERRORS = 100


class InputReader:
    def __init__(self, store: Store, limits: ValidationLimits, models: Container[str] = ()) -> None:
        self.store = store
        self.limits = limits
        self.models = models
        """The names a file's lines may mix: the served model's and its LoRA adapters'."""

    def prepare(self, batch: Batch) -> Iterator[None]:
        """Read back what a resumed batch had written, then validate the input and count its unanswered work; a
        generator that yields after each line, so the loop reads a big file a slice at a time."""
        batch.tally, batch.errors = Tally(), []
        for path in self.store.results_paths(batch.record):
            yield from recover(path, batch.tally)
        if batch.status not in ("validating", "in_progress"):  # cancelling or finalizing: nothing more to write
            batch.work = 0
            return
        batch.total = batch.work = 0
        for item in self._items(batch):
            if isinstance(item, LineError):
                if len(batch.errors) < MAX_REPORTED_ERRORS:
                    batch.errors.append(item.to_batch_error())
            else:
                batch.total += 1
                if item.custom_id not in batch.tally.done:
                    batch.work += sequences_of(item.body)
            yield

    def unanswered(self, batch: Batch) -> Iterator[BatchInputLine]:
        for item in self._items(batch):
            if isinstance(item, LineError):
                raise RuntimeError(f"the input file changed after it was validated: line {item.line}: {item.message}")
            if item.custom_id not in batch.taken:
                batch.taken.add(item.custom_id)
                yield item

    def next_line(self, batch: Batch) -> BatchInputLine | None:
        """The next unanswered line of the input (``None`` at its end); after an error reading it, a retry goes on
        from where it was."""
        assert batch.lines is not None
        try:
            line = next(batch.lines, None)
        except Exception:
            batch.lines = self.unanswered(batch)  # a new pass skips every line already taken
            raise
        if line is None:
            batch.lines = None
        return line

    def _items(self, batch: Batch) -> Iterator[BatchInputLine | LineError]:
        endpoint = batch.record.endpoint or None
        return iter_input_lines(
            self.store.input_path(batch.record), endpoint=endpoint, limits=self.limits, family=self.models
        )
