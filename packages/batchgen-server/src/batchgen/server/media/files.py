"""Images uploaded through ``POST /v1/files`` (purpose ``vision`` or ``user_data``), read by the file id a request's
part names: only the caller's own (its tenant's), checked against the size and checksum they were stored with."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from .errors import MediaError

IMAGE_PURPOSES = ("vision", "user_data")

_owner: ContextVar[str | None] = ContextVar("batchgen_media_owner", default=None)
"""The tenant whose request is being prepared: the files its parts may name (set by the online endpoints and the
batch loop's tokenizing thread around ``prepare``)."""


@contextlib.contextmanager
def files_of(owner: str) -> Iterator[None]:
    token = _owner.set(owner)
    try:
        yield
    finally:
        _owner.reset(token)


class UploadedImages:
    def __init__(self, db: Any, blobs: Any) -> None:
        self.db = db
        self.blobs = blobs

    def __call__(self, file_id: str, param: str, max_bytes: int) -> bytes:
        owner = _owner.get()
        if owner is not None:  # a background response runs as a batch of "<owner>/responses": the owner's images
            owner = owner.removesuffix("/responses")
        file = None if owner is None else self.db.get_file(file_id, owner=owner)
        if file is None:
            raise MediaError("file_not_found", f"No file {file_id!r}.", param)
        if file.purpose not in IMAGE_PURPOSES:
            raise MediaError(
                "invalid_value", f"File {file_id!r} has purpose {file.purpose!r}; an image needs 'vision'.", param
            )
        if file.bytes > max_bytes:
            raise MediaError("image_too_large", f"The image is over {max_bytes} bytes.", param)
        return b"".join(self.blobs.read_verified(file_id, size=file.bytes, checksum=file.checksum))
