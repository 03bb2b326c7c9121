"""Read a ``multipart/form-data`` upload straight from the request stream: the file part goes chunk by chunk to a
blob (hashed and checked on the way, constant memory), the small text fields into a dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from litestar import Request
from multipart import MultipartSegment, ParserError, ParserLimitReached, PushMultipartParser

from batchgen.schemas.validation import LineError, UploadChecker, ValidationLimits

from ..security.limits import sanitize_filename
from ..storage.blobs import BlobStore, UploadWriter
from .errors import APIError, invalid

MAX_FIELD_BYTES = 4096
MAX_PARTS = 16


@dataclass(slots=True)
class UploadForm:
    fields: dict[str, str] = field(default_factory=dict)
    file: UploadWriter | None = None
    filename: str = ""
    check_error: LineError | None = None
    """The first problem the upload-time check found in the file (UTF-8, JSONL, limits)."""
    newlines: int = 0
    ends_with_newline: bool = True

    @property
    def line_count(self) -> int:
        """Lines in the file (blank ones included: an upper bound on its requests, which backpressure uses)."""
        return self.newlines + (0 if self.ends_with_newline else 1)


async def read_upload(request: Request[Any, Any, Any], blobs: BlobStore, limits: ValidationLimits) -> UploadForm:
    """Parse the form; on any failure the partial blob is removed and an ``APIError`` raised."""
    content_type, options = request.content_type
    if content_type != "multipart/form-data" or not options.get("boundary"):
        raise APIError(
            415, "Uploads must be multipart/form-data with a 'file' and a 'purpose' field.", code="invalid_content_type"
        )
    form = UploadForm()
    try:
        await _parse(request, options["boundary"], blobs, limits, form)
    except BaseException:
        if form.file is not None:
            form.file.discard()
        raise
    return form


async def _parse(
    request: Request[Any, Any, Any], boundary: str, blobs: BlobStore, limits: ValidationLimits, form: UploadForm
) -> None:
    checker: UploadChecker | None = None
    segment: MultipartSegment | None = None
    text = bytearray()
    try:
        with PushMultipartParser(boundary, max_segment_count=MAX_PARTS) as parser:
            async for chunk in request.stream():
                for part in parser.parse(chunk):
                    if isinstance(part, MultipartSegment):
                        segment, text = part, bytearray()
                        if segment.name == "file":
                            if form.file is not None:
                                raise invalid("Send exactly one 'file' part.", param="file")
                            form.file, form.filename = blobs.new_upload(), sanitize_filename(segment.filename)
                            checker = UploadChecker(limits)
                    elif part:
                        assert segment is not None
                        if segment.name == "file" and form.file is not None and checker is not None:
                            data = bytes(part)
                            form.file.write(data)
                            form.newlines += data.count(b"\n")
                            form.ends_with_newline = data.endswith(b"\n")
                            if form.file.size > limits.max_file_bytes:
                                raise _too_large(limits)
                            if form.check_error is None:
                                form.check_error = checker.feed(data)
                        else:
                            text += part
                            if len(text) > MAX_FIELD_BYTES:
                                raise invalid(f"The form field '{segment.name}' is too long.", param=segment.name)
                    else:
                        assert segment is not None
                        if segment.name != "file" and segment.name:
                            form.fields[segment.name] = text.decode("utf-8", errors="replace")
                        segment = None
            parser.parse(b"")
    except ParserLimitReached as exc:
        raise invalid(f"Too many form parts (at most {MAX_PARTS}).", param=None, code="invalid_multipart") from exc
    except ParserError as exc:
        raise invalid(f"Malformed multipart body: {exc}", param=None, code="invalid_multipart") from exc
    if checker is not None and form.check_error is None:
        form.check_error = checker.finish()


def _too_large(limits: ValidationLimits) -> APIError:
    return APIError(
        413, f"The file exceeds the upload limit of {limits.max_file_bytes} bytes.", code="file_too_large", param="file"
    )
