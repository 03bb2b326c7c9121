"""Files past their ``expires_after``: rows and contents deleted at startup and then periodically."""

from __future__ import annotations

import asyncio
import logging
import time

from .blobs import BlobStore
from .database import Database

log = logging.getLogger("batchgen.server.expiry")


def sweep_expired_files(db: Database, blobs: BlobStore) -> list[str]:
    """Delete every expired file no unfinished batch uses; the ids deleted."""
    expired = db.expired_files(int(time.time()))
    for file_id in expired:
        db.delete_file(file_id)
        blobs.delete(file_id)
    if expired:
        log.info("deleted %d expired file(s)", len(expired))
    return expired


async def sweep_forever(db: Database, blobs: BlobStore, interval_s: float) -> None:
    """The lifespan's background task: a sweep now, then one every ``interval_s``."""
    while True:
        try:
            await asyncio.to_thread(sweep_expired_files, db, blobs)
        except Exception:  # a locked database, a full disk: try again next time
            log.exception("expired-file sweep failed")
        await asyncio.sleep(interval_s)
