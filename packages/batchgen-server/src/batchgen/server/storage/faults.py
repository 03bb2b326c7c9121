"""Storage faults: a full or failing disk, or no file descriptor left, recognised alike whether a file operation or
the database hit it.

A fault is not a bug: the batch loop pauses the batch it hit and retries until the storage recovers; the API keeps
nothing of the refused request and answers 507 ``insufficient_storage`` (the disk) or 503 with ``Retry-After``
(descriptors, which come back as soon as other requests close theirs).
"""

from __future__ import annotations

import errno
import os
import sqlite3

_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)
_DESCRIPTOR_ERRNOS = (errno.EMFILE, errno.ENFILE)
_SQLITE_DISK_CODES = (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR)
_SQLITE_DESCRIPTOR_CODES = (sqlite3.SQLITE_CANTOPEN,)
"""What SQLite answers when it cannot open a file (it does not say why): once the server runs, that is a connection
opened with no descriptor left."""


def storage_fault(exc: BaseException) -> str | None:
    """What went wrong with the storage, in a few words (``"No space left on device"``), or ``None`` if ``exc`` is
    not a storage fault."""
    if isinstance(exc, OSError) and exc.errno in (*_DISK_ERRNOS, *_DESCRIPTOR_ERRNOS):
        return exc.strerror or os.strerror(exc.errno)
    if _sqlite_code(exc) in (*_SQLITE_DISK_CODES, *_SQLITE_DESCRIPTOR_CODES):
        return f"database: {exc}"
    return None


def out_of_descriptors(exc: BaseException) -> bool:
    """The storage fault is the process (or system) out of file descriptors: the disk is fine, retry shortly."""
    if isinstance(exc, OSError):
        return exc.errno in _DESCRIPTOR_ERRNOS
    return _sqlite_code(exc) in _SQLITE_DESCRIPTOR_CODES


def _sqlite_code(exc: BaseException) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(exc, sqlite3.Error) and code is not None else None
