"""File objects (``/v1/files``)."""

from __future__ import annotations

from typing import Literal

from ._base import Wire

FilePurpose = Literal["batch", "batch_output", "vision", "user_data"]
"""``vision`` and ``user_data``: an image that requests name by its id (``file`` / ``input_image`` parts)."""
FileStatus = Literal["uploaded", "processed", "error"]


class FileObject(Wire, kw_only=True):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: FileStatus = "processed"
    status_details: str | None = None
    expires_at: int | None = None
    checksum: str | None = None
    """``sha256:<hex>`` of the content (a batchgen extension)."""


class FileDeleted(Wire, kw_only=True):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class FileList(Wire, kw_only=True):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
