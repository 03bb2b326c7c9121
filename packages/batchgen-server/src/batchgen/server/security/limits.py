"""Limits on what callers may send, each failing with a clear OpenAI-style error (HTTP 400).

The server maps :class:`LimitError` to ``{"error": {message, type, param, code}}`` with ``status_code``; like every
other bad value in the API its code is ``invalid_value`` and the message says what is wrong.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from typing import Literal

MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_LENGTH = 64
MAX_METADATA_VALUE_LENGTH = 512
MAX_FILENAME_BYTES = 255
"""The common file-system limit on one name, so a stored or downloaded name never fails to be written."""
DEFAULT_FILENAME = "upload.jsonl"

_ID_PREFIXES = {"file": "file-", "batch": "batch_"}
_ID_PATTERNS = {kind: re.compile(re.escape(prefix) + "[0-9a-f]{1,64}") for kind, prefix in _ID_PREFIXES.items()}


class LimitError(ValueError):
    """Input over a limit or of the wrong shape; carries everything the error envelope needs."""

    def __init__(self, message: str, *, param: str | None, code: str = "invalid_value", status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status_code = status_code


def validate_metadata(metadata: object) -> dict[str, str] | None:
    """At most 16 string keys of at most 64 characters, each with a string value of at most 512 characters."""
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        message = "'metadata' must be an object of string keys and values."
        raise LimitError(message, param="metadata")
    if len(metadata) > MAX_METADATA_KEYS:
        raise LimitError(
            f"'metadata' has {len(metadata)} keys; at most {MAX_METADATA_KEYS} are allowed.",
            param="metadata",
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise LimitError(
                f"'metadata' keys and values must be strings; got {type(value).__name__} for key {key!r}.",
                param="metadata",
            )
        if len(key) > MAX_METADATA_KEY_LENGTH:
            raise LimitError(
                f"'metadata' key {key[:MAX_METADATA_KEY_LENGTH]!r}... has {len(key)} characters; "
                f"at most {MAX_METADATA_KEY_LENGTH} are allowed.",
                param="metadata",
            )
        if len(value) > MAX_METADATA_VALUE_LENGTH:
            raise LimitError(
                f"'metadata' value of key {key!r} has {len(value)} characters; "
                f"at most {MAX_METADATA_VALUE_LENGTH} are allowed.",
                param="metadata",
            )
    return {str(key): str(value) for key, value in metadata.items()}


def sanitize_filename(name: str | None) -> str:
    """A safe display name for an upload: no directories, no control or invisible characters, bounded length.

    The name is only ever shown and echoed in ``Content-Disposition``; blobs are stored under their file id, so
    nothing here decides a path on disk. Sanitizing still keeps logs, terminals and downloads safe.
    """
    base = re.split(r"[/\\]", name or "")[-1]
    # Cc: control characters (NUL, newlines, ESC); Cf: invisible format characters such as bidi overrides.
    kept = "".join(ch for ch in base if unicodedata.category(ch) not in ("Cc", "Cf") and ch not in '"')
    kept = kept.strip().lstrip(".").strip()
    if not kept:
        return DEFAULT_FILENAME
    if len(kept.encode()) <= MAX_FILENAME_BYTES:
        return kept
    head, dot, extension = kept.rpartition(".")
    suffix = f".{extension}" if dot and head and len(extension) <= 16 else ""
    stem = kept[: len(kept) - len(suffix)]
    budget = MAX_FILENAME_BYTES - len(suffix.encode())
    return stem.encode()[:budget].decode(errors="ignore") + suffix


def is_valid_id(value: str, kind: Literal["file", "batch"]) -> bool:
    """``file-<hex>`` or ``batch_<hex>`` as the server makes them; anything else (``..``, slashes) names nothing.

    Lookups treat an invalid id as not found (404, like any unknown id) without touching storage, and the blob store
    refuses to build a path from one, so no id can walk out of the storage directory.
    """
    return _ID_PATTERNS[kind].fullmatch(value) is not None
