"""A batch's answered lines on their way to its results files: each appended whole, fsynced at least every
``flush_interval_s``, and only then counted done and its counts published (``Store.update``).

A failed fsync cuts a file back to its last durable size (``ResultsFile``): the lines it lost are appended again, in
order, by the next ``write``, so a storage fault costs a retry, never a line.
"""

from __future__ import annotations

import time

import msgspec

from batchgen.schemas import BatchOutputLine

from ..storage.blobs import ResultsLost
from .results import succeeded
from .state import Answer, Batch
from .stores import Store

_encode = msgspec.json.Encoder().encode


class ResultsWriter:
    def __init__(self, store: Store, flush_interval_s: float) -> None:
        self.store = store
        self.flush_interval_s = min(flush_interval_s, 1.0)

    def answer(self, batch: Batch, line: BatchOutputLine, work: int) -> None:
        """Queue ``line`` for the output or the error file; its ``work`` (sequences) is no longer the batch's."""
        assert batch.results is not None
        output, errors = batch.results
        batch.unwritten.append(Answer(line, _encode(line) + b"\n", output if succeeded(line) else errors))
        batch.work -= work

    def write(self, batch: Batch, *, sync: bool) -> None:
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

    def close(self, batch: Batch) -> None:
        for file in batch.files():
            file.close()

    def _sync(self, batch: Batch) -> None:
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
