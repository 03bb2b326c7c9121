"""File contents on disk: ``<storage>/blobs/<file id>``, written through a temporary file and renamed into place
(uploads), or appended line by line (batch results)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from ..security.limits import is_valid_id

CHUNK = 1024 * 1024


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp = root / ".tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        for stale in self.tmp.iterdir():  # uploads cut short by a crash
            stale.unlink(missing_ok=True)

    def path(self, file_id: str) -> Path:
        """Where a file's content lives; only ever built from an id the server made, so it stays in ``root``."""
        if not is_valid_id(file_id, "file"):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / file_id

    def size(self, file_id: str) -> int:
        try:
            return self.path(file_id).stat().st_size
        except FileNotFoundError:
            return 0

    def new_upload(self) -> UploadWriter:
        return UploadWriter(self)

    def open_results(self, file_id: str) -> ResultsFile:
        return ResultsFile(self.path(file_id))

    def read(self, file_id: str, *, length: int) -> Iterator[bytes]:
        """The first ``length`` bytes, in chunks; the file is opened at once (``FileNotFoundError`` here, not later
        while the chunks are read)."""
        return _chunks(open(self.path(file_id), "rb"), length)

    def checksum(self, file_id: str) -> str:
        digest = hashlib.sha256()
        for chunk in self.read(file_id, length=self.size(file_id)):
            digest.update(chunk)
        return f"sha256:{digest.hexdigest()}"

    def complete_lines_length(self, file_id: str) -> int:
        """Bytes up to the last newline: what a reader may see of a file still being appended to."""
        path = self.path(file_id)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return 0
        with open(path, "rb") as f:
            end = size
            while end > 0:
                start = max(0, end - 65536)
                f.seek(start)
                block = f.read(end - start)
                newline = block.rfind(b"\n")
                if newline >= 0:
                    return start + newline + 1
                end = start
        return 0

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)


class UploadWriter:
    """Streams an upload to a temporary file, hashing it on the way; ``commit`` makes it durable under its id."""

    def __init__(self, store: BlobStore) -> None:
        self._store = store
        fd, name = tempfile.mkstemp(dir=store.tmp)
        self._file = os.fdopen(fd, "wb")
        self._tmp_path = Path(name)
        self._sha256 = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        self._file.write(chunk)
        self._sha256.update(chunk)
        self.size += len(chunk)

    @property
    def checksum(self) -> str:
        return f"sha256:{self._sha256.hexdigest()}"

    def commit(self, file_id: str) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp_path, self._store.path(file_id))
        _fsync_dir(self._store.root)

    def discard(self) -> None:
        self._tmp_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # closing flushes what is buffered, which fails again on a full disk
            self._file.close()


class ResultsFile:
    """An append-only JSONL file of batch results where a line is appended whole or not at all.

    ``size`` counts the bytes of whole lines appended, ``synced_size`` those known durable. A failed append or fsync
    (a full disk, an I/O error) cuts the file back before raising: to where it was for an append, to the last
    durable size for an fsync (the caller appends those lines again). A line is never glued to a torn one, and if the
    cut itself fails, nothing more is appended until a later cut succeeds.
    """

    def __init__(self, path: Path, *, fresh: bool = False) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if fresh else 0)
        self._fd = os.open(path, flags, 0o644)
        self.size = self.synced_size = os.fstat(self._fd).st_size
        self._torn = False

    def append(self, line: bytes) -> None:
        self._cut(self.size)  # only if an earlier cut failed
        view = memoryview(line)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            self._torn = True
            self._cut(self.size)
            raise
        self.size += len(line)

    def sync(self) -> None:
        if self.synced_size == self.size:
            return
        try:
            os.fsync(self._fd)
        except OSError:  # what was written since the last fsync may be lost: write it again
            self.size, self._torn = self.synced_size, True
            self._cut(self.size)
            raise
        self.synced_size = self.size

    def _cut(self, size: int) -> None:
        if self._torn:
            os.ftruncate(self._fd, size)
            self._torn = False

    def close(self) -> None:
        os.close(self._fd)


def _chunks(f: BinaryIO, length: int) -> Iterator[bytes]:
    with f:
        while length > 0 and (chunk := f.read(min(CHUNK, length))):
            length -= len(chunk)
            yield chunk


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
