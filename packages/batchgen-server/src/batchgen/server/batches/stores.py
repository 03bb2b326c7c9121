"""Where the batch loop keeps what outlives it: the server's database and blobs, or run-batch's plain files.

The loop decides; a store only records. Each method is one step the loop may retry after a storage fault, so each
either happens whole or not at all (one database transaction, or idempotent file operations).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from batchgen.schemas import BatchObject, FileObject

from ..ids import new_file_id
from ..storage.blobs import BlobStore, ResultsFile, ResultsLost
from ..storage.database import Database

Results = tuple[ResultsFile, ResultsFile]
"""A batch's output and error files, open for appending (the same object twice when both go to one file)."""


class Store(Protocol):
    def unfinished(self) -> list[tuple[BatchObject, str]]:
        """Batches to resume at start-up, oldest first, each with its owner (tenant)."""
        ...

    def insert(self, batch: BatchObject, owner: str, output_expiry_s: int | None = None) -> None:
        """Record a new batch; its results files expire ``output_expiry_s`` after they are created (``None``:
        never)."""
        ...

    def get(self, batch_id: str, owner: str) -> BatchObject | None: ...

    def input_path(self, batch: BatchObject) -> Path: ...

    def results_paths(self, batch: BatchObject) -> list[Path]:
        """The results files of a batch that has started (none before)."""
        ...

    def start(self, batch: BatchObject, owner: str, **fields: Any) -> BatchObject:
        """Create the batch's empty results files and set ``fields`` (``status="in_progress"``...): the batch as it
        now is, naming its results files."""
        ...

    def open_results(self, batch: BatchObject) -> Results: ...

    def update(self, batch_id: str, **fields: Any) -> None: ...

    def finish(self, batch: BatchObject, **fields: Any) -> None:
        """Publish the results files (an empty one is dropped) and set the batch's final ``fields``."""
        ...


class DatabaseStore:
    """The server's: batch rows in SQLite, results files as blobs; ``on_finished`` hears of each final batch."""

    def __init__(
        self, db: Database, blobs: BlobStore, on_finished: Callable[[BatchObject], None] | None = None
    ) -> None:
        self.db = db
        self.blobs = blobs
        self.on_finished = on_finished

    def unfinished(self) -> list[tuple[BatchObject, str]]:
        return self.db.unfinished_batches()

    def insert(self, batch: BatchObject, owner: str, output_expiry_s: int | None = None) -> None:
        self.db.insert_batch(batch, owner=owner, output_expiry_s=output_expiry_s)

    def get(self, batch_id: str, owner: str) -> BatchObject | None:
        return self.db.get_batch(batch_id, owner=owner)

    def input_path(self, batch: BatchObject) -> Path:
        return self.blobs.path(batch.input_file_id)

    def results_paths(self, batch: BatchObject) -> list[Path]:
        return [self.blobs.path(file_id) for file_id in _results_ids(batch)]

    def start(self, batch: BatchObject, owner: str, **fields: Any) -> BatchObject:
        created_at = int(time.time())
        expiry = self.db.output_expiry(batch.id)
        files = [
            FileObject(
                id=file_id,
                bytes=0,
                created_at=created_at,
                filename=f"{batch.id}_{kind}.jsonl",
                purpose="batch_output",
                status="uploaded",
                expires_at=None if expiry is None else created_at + expiry,
            )
            for kind, file_id in (("output", new_file_id()), ("error", new_file_id()))
        ]
        ids = {"output_file_id": files[0].id, "error_file_id": files[1].id}
        try:
            for file in files:
                self.blobs.path(file.id).touch()
            self.db.start_batch(batch.id, owner=owner, files=files, **ids, **fields)
        except BaseException:  # a full disk: retried later with new files, so leave none of these behind
            for file in files:
                self.blobs.delete(file.id)
            raise
        started = self.db.get_batch(batch.id, owner=owner)
        assert started is not None
        return started

    def open_results(self, batch: BatchObject) -> Results:
        output, errors = (self.blobs.open_results(file_id) for file_id in _results_ids(batch))
        return output, errors

    def update(self, batch_id: str, **fields: Any) -> None:
        self.db.update_batch(batch_id, **fields)

    def finish(self, batch: BatchObject, **fields: Any) -> None:
        """An empty results file is dropped (``null`` in the batch); so is a missing one, unless the batch completes
        (``ResultsLost``: ``completed`` needs its lines). The batch's row and its files' rows change in one
        transaction, so a crash leaves the unfinished batch (resumed, published again) or the finished one."""
        publish: dict[str, tuple[int, str]] = {}
        drop: list[str] = []
        for column, file_id in (("output_file_id", batch.output_file_id), ("error_file_id", batch.error_file_id)):
            if file_id is None:
                continue
            try:
                size, checksum = self.blobs.fingerprint(file_id)
            except FileNotFoundError:
                if fields["status"] == "completed":
                    raise ResultsLost(f"{file_id} disappeared from the server's storage before completion") from None
                size = 0
            if size:
                publish[file_id] = (size, checksum)
            else:
                drop.append(file_id)
                fields[column] = None
        self.db.finish_batch(batch.id, publish=publish, drop=drop, **fields)
        for file_id in drop:
            self.blobs.delete(file_id)
        finished = self.db.get_batch(batch.id, owner=None)
        if self.on_finished is not None and finished is not None:
            self.on_finished(finished)


class FileStore:
    """run-batch's: one batch read from ``input_path`` and answered into plain files (errors into the output file
    when ``errors_path`` is ``None``); what the loop records stays in ``fields``, and ``on_update`` hears of it."""

    def __init__(
        self,
        input_path: Path,
        output_path: Path,
        errors_path: Path | None,
        on_update: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self._input = input_path
        self._paths = (output_path, errors_path or output_path)
        self._on_update = on_update
        self.fields: dict[str, Any] = {}
        self.finished = threading.Event()

    def unfinished(self) -> list[tuple[BatchObject, str]]:
        return []

    def insert(self, batch: BatchObject, owner: str, output_expiry_s: int | None = None) -> None:
        self.batch = batch

    def get(self, batch_id: str, owner: str) -> BatchObject | None:
        return self.batch

    def input_path(self, batch: BatchObject) -> Path:
        return self._input

    def results_paths(self, batch: BatchObject) -> list[Path]:
        return []  # nothing to resume: every run starts afresh

    def start(self, batch: BatchObject, owner: str, **fields: Any) -> BatchObject:
        for path in self._paths:
            path.write_bytes(b"")
        self.update(batch.id, **fields)
        return batch

    def open_results(self, batch: BatchObject) -> Results:
        output = ResultsFile(self._paths[0])
        return output, output if self._paths[1] == self._paths[0] else ResultsFile(self._paths[1])

    def update(self, batch_id: str, **fields: Any) -> None:
        self.fields.update(fields)
        if self._on_update is not None:
            self._on_update(self.fields)

    def finish(self, batch: BatchObject, **fields: Any) -> None:
        self.update(batch.id, **fields)
        self.finished.set()


def _results_ids(batch: BatchObject) -> list[str]:
    return [file_id for file_id in (batch.output_file_id, batch.error_file_id) if file_id is not None]
