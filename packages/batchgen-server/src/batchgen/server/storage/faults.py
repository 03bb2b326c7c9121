"""Storage faults: a full or failing disk, recognised alike whether a file write or the database hit it.

A fault is not a bug: the batch loop pauses the batch it hit and retries until the disk recovers; the API answers
507 ``insufficient_storage`` and keeps nothing of the refused request.
"""

from __future__ import annotations

import errno
import os
import sqlite3

_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)
_SQLITE_CODES = (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR)


def storage_fault(exc: BaseException) -> str | None:
    """What went wrong with the storage, in a few words (``"No space left on device"``), or ``None`` if ``exc`` is
    not a storage fault."""
    if isinstance(exc, OSError) and exc.errno in _ERRNOS:
        return exc.strerror or os.strerror(exc.errno)
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(exc, sqlite3.Error) and code is not None and code & 0xFF in _SQLITE_CODES:
        return f"database: {exc}"
    return None
