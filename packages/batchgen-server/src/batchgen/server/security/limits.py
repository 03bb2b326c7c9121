"""Limits on what callers may send, each failing with a clear OpenAI-style error (HTTP 400).

The server maps :class:`LimitError` to ``{"error": {message, type, param, code}}`` with ``status_code``.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping

from batchgen.schemas import ErrorDetail, ErrorResponse

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

    def __init__(self, message: str, *, param: str | None, code: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status_code = status_code
        self.type = "invalid_request_error"

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))


def validate_metadata(metadata: object) -> dict[str, str] | None:
    """At most 16 string keys of at most 64 characters, each with a string value of at most 512 characters."""
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        message = "'metadata' must be an object of string keys and values."
        raise LimitError(message, param="metadata", code="invalid_type")
    if len(metadata) > MAX_METADATA_KEYS:
        raise LimitError(
            f"'metadata' has {len(metadata)} keys; at most {MAX_METADATA_KEYS} are allowed.",
            param="metadata",
            code="object_above_max_properties",
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise LimitError(
                f"'metadata' keys and values must be strings; got {type(value).__name__} for key {key!r}.",
                param="metadata",
                code="invalid_type",
            )
        if len(key) > MAX_METADATA_KEY_LENGTH:
            raise LimitError(
                f"'metadata' key {key[:MAX_METADATA_KEY_LENGTH]!r}... has {len(key)} characters; "
                f"at most {MAX_METADATA_KEY_LENGTH} are allowed.",
                param="metadata",
                code="string_above_max_length",
            )
        if len(value) > MAX_METADATA_VALUE_LENGTH:
            raise LimitError(
                f"'metadata' value of key {key!r} has {len(value)} characters; "
                f"at most {MAX_METADATA_VALUE_LENGTH} are allowed.",
                param="metadata",
                code="string_above_max_length",
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


def validate_id(value: str, kind: str, *, param: str) -> str:
    """``file-<hex>`` or ``batch_<hex>``; anything else (``..``, slashes, other prefixes) is refused before lookup."""
    if not _ID_PATTERNS[kind].fullmatch(value):
        shown = value if len(value) <= 80 else value[:80] + "..."
        raise LimitError(
            f"Invalid {kind} id {shown!r}: expected '{_ID_PREFIXES[kind]}' followed by 1 to 64 lowercase hex digits.",
            param=param,
            code="invalid_id",
        )
    return value


def validate_file_id(value: str, *, param: str = "file_id") -> str:
    return validate_id(value, "file", param=param)


def validate_batch_id(value: str, *, param: str = "batch_id") -> str:
    return validate_id(value, "batch", param=param)
