"""File contents on disk: ``<storage>/blobs/<file id>``, written through a temporary file and renamed into place
(uploads), or appended line by line (batch results)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from ..security.limits import is_valid_id

CHUNK = 1024 * 1024
log = logging.getLogger("batchgen.server.blobs")


class ContentCorrupt(Exception):
    """A finished file's content on disk is not what was stored: another size, or another checksum."""


class ResultsLost(Exception):
    """A results file was cut short outside the server: lines already counted as done are gone."""


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp = root / ".tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        for stale in self.tmp.iterdir():  # uploads cut short by a crash
            stale.unlink(missing_ok=True)
        self._verified: dict[str, tuple[_Identity, str | None]] = {}
        """Finished files whose content was hashed, and the checksum found: not hashed again until they change."""

    def path(self, file_id: str) -> Path:
        """Where a file's content lives; only ever built from an id the server made, so it stays in ``root``."""
        if not is_valid_id(file_id, "file"):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / file_id

    def new_upload(self) -> UploadWriter:
        return UploadWriter(self)

    def open_results(self, file_id: str) -> ResultsFile:
        return ResultsFile(self.path(file_id), tmp=self.tmp)

    def read(self, file_id: str, *, length: int) -> Iterator[bytes]:
        """The first ``length`` bytes, in chunks; the file is opened at once (``FileNotFoundError`` here, not later
        while the chunks are read)."""
        return _chunks(open(self.path(file_id), "rb"), length)

    def read_verified(self, file_id: str, *, size: int, checksum: str | None) -> Iterator[bytes]:
        """A finished file's content, in chunks, once it is known to be the ``size`` bytes of ``checksum``
        (``ContentCorrupt`` otherwise, before any chunk). Hashed the first time, then only after it changed."""
        with contextlib.ExitStack() as on_error:
            f = on_error.enter_context(open(self.path(file_id), "rb"))
            identity = _identity(f)
            if identity[2] != size:
                raise ContentCorrupt(f"{file_id} holds {identity[2]} bytes, not {size}")
            if checksum is not None and self._verified.get(file_id) != (identity, checksum):
                if _digest(f) != checksum:
                    raise ContentCorrupt(f"{file_id} does not match its checksum")
                self._verified[file_id] = (identity, checksum)
                f.seek(0)
            on_error.pop_all()  # verified: the chunks close it
        return _chunks(f, size)

    def fingerprint(self, file_id: str) -> tuple[int, str]:
        """A finished file's size and checksum (``FileNotFoundError`` if it is missing), remembered as verified."""
        with open(self.path(file_id), "rb") as f:
            identity = _identity(f)
            checksum = _digest(f)
        self._verified[file_id] = (identity, checksum)
        return identity[2], checksum

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
        self._verified.pop(file_id, None)


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

    def written(self) -> bytes:
        """What was written so far (an uploaded image, checked before it is committed)."""
        self._file.flush()
        return self._tmp_path.read_bytes()

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

    Each ``sync`` also checks that the file at ``path`` is still ours and whole: one deleted or replaced is put back
    from our descriptor, which still holds every byte (a copy made in ``tmp``, renamed into place); one cut short
    raises ``ResultsLost``, since lines counted as done are gone and no copy of them exists.
    """

    def __init__(self, path: Path, *, tmp: Path | None = None) -> None:
        self.path = path
        self._tmp = tmp or path.parent
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)  # read back by ``_restore``
        self.size = self.synced_size = os.fstat(self._fd).st_size
        self._torn = False

    def append(self, line: bytes) -> None:
        self._cut(self.size)  # only if an earlier cut failed
        try:
            _write_all(self._fd, line)
        except OSError:
            self._torn = True
            self._cut(self.size)
            raise
        self.size += len(line)

    def sync(self) -> None:
        try:
            self._check()
            if self.synced_size == self.size:
                return
            os.fsync(self._fd)
        except OSError:  # what was written since the last fsync may be lost (or not put back): write it again
            self.size, self._torn = self.synced_size, True
            self._cut(self.size)
            raise
        self.synced_size = self.size

    def _check(self) -> None:
        mine = os.fstat(self._fd)
        if mine.st_size < self.size:
            raise self._lost(mine.st_size)
        try:
            there: os.stat_result | None = os.stat(self.path)
        except FileNotFoundError:
            there = None
        if there is None or (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
            self._restore(stat.S_IMODE(mine.st_mode))

    def _restore(self, mode: int) -> None:
        """Copy our whole lines to a new file, durably, put it at ``path`` and append to it from now on; on a failure
        nothing changes here (our descriptor still holds everything) and a later ``sync`` tries again."""
        fd, name = tempfile.mkstemp(dir=self._tmp)
        try:
            offset = 0
            while offset < self.size:
                chunk = os.pread(self._fd, min(CHUNK, self.size - offset), offset)
                if not chunk:
                    raise self._lost(offset)
                _write_all(fd, chunk)
                offset += len(chunk)
            os.fchmod(fd, mode)
            os.fsync(fd)
            os.replace(name, self.path)
            _fsync_dir(self.path.parent)
            appending = os.open(self.path, os.O_RDWR | os.O_APPEND)  # as ``__init__`` opens it
        except BaseException:
            os.close(fd)
            Path(name).unlink(missing_ok=True)
            raise
        os.close(fd)
        os.close(self._fd)
        self._fd, self.synced_size, self._torn = appending, self.size, False
        log.warning("%s was deleted or replaced while its batch ran; restored from the open file", self.path.name)

    def _lost(self, size: int) -> ResultsLost:
        lost = self.size - size
        return ResultsLost(f"{self.path.name} was cut short outside the server: {lost} bytes of results are gone")

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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


_Identity = tuple[int, int, int, int, int]


def _identity(f: BinaryIO) -> _Identity:
    """Device, inode, size, and modification and change times: one of them differs once the content may have changed
    (the change time cannot be set by hand)."""
    st = os.fstat(f.fileno())
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _digest(f: io.BufferedReader) -> str:
    f.seek(0)
    return f"sha256:{hashlib.file_digest(f, 'sha256').hexdigest()}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
