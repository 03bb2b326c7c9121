"""Read a ``multipart/form-data`` upload straight from the request stream: the file part goes to a blob in ~1 MB
pieces (written, hashed and checked in a worker thread, never on the event loop, in constant memory), the small text
fields into a dict. An upload that goes quiet for ``idle_timeout_s`` is dropped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
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
MAX_HEADER_BYTES = 64 * 1024
"""Longest header line of a part: room for a long file name (sanitized and cut to 255 bytes, not refused)."""
PIECE_BYTES = 1024 * 1024
"""File bytes gathered before they go to the worker thread: few thread hops, little memory."""


@dataclass(slots=True)
class UploadForm:
    fields: dict[str, str] = field(default_factory=dict)
    file: UploadWriter | None = None
    filename: str = ""
    checker: UploadChecker | None = None
    """The upload-time check of the file part: its first error, its requests and the sequences they ask for."""

    @property
    def check_error(self) -> LineError | None:
        return None if self.checker is None else self.checker.error


async def read_upload(
    request: Request[Any, Any, Any], blobs: BlobStore, limits: ValidationLimits, idle_timeout_s: float
) -> UploadForm:
    """Parse the form; on any failure the partial blob is removed and an ``APIError`` raised."""
    content_type, options = request.content_type
    if content_type != "multipart/form-data" or not options.get("boundary"):
        raise APIError(
            415, "Uploads must be multipart/form-data with a 'file' and a 'purpose' field.", code="invalid_content_type"
        )
    form = UploadForm()
    try:
        await _parse(_chunks(request, idle_timeout_s), options["boundary"], blobs, limits, form)
    except BaseException:
        if form.file is not None:
            await asyncio.shield(asyncio.to_thread(form.file.discard))  # even when the client went away
        raise
    return form


async def _chunks(request: Request[Any, Any, Any], idle_timeout_s: float) -> AsyncIterator[bytes]:
    stream = request.stream()
    while True:
        try:
            async with asyncio.timeout(idle_timeout_s):
                chunk = await anext(stream)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise APIError(
                408, f"The upload sent nothing for {idle_timeout_s:g} s and was dropped.", code="upload_timeout"
            ) from None
        yield chunk


async def _parse(
    chunks: AsyncIterator[bytes], boundary: str, blobs: BlobStore, limits: ValidationLimits, form: UploadForm
) -> None:
    segment: MultipartSegment | None = None
    text = bytearray()
    piece = bytearray()
    size = 0
    try:
        with PushMultipartParser(boundary, max_header_size=MAX_HEADER_BYTES, max_segment_count=MAX_PARTS) as parser:
            async for chunk in chunks:
                for part in parser.parse(chunk):
                    if isinstance(part, MultipartSegment):
                        segment, text = part, bytearray()
                        if segment.name == "file":
                            if form.file is not None:
                                raise invalid("Send exactly one 'file' part.", param="file")
                            form.file = await asyncio.to_thread(blobs.new_upload)
                            form.filename, form.checker = sanitize_filename(segment.filename), UploadChecker(limits)
                    elif part:
                        assert segment is not None
                        if segment.name == "file" and form.file is not None:
                            size += len(part)
                            if size > limits.max_file_bytes:
                                raise _too_large(limits)
                            piece += part
                            if len(piece) >= PIECE_BYTES:
                                await _store(form, piece)
                                piece = bytearray()
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
        bounds = f"at most {MAX_PARTS} parts, each header line at most {MAX_HEADER_BYTES} bytes"
        raise invalid(f"The form is over a limit: {exc} ({bounds}).", param=None, code="invalid_multipart") from exc
    except ParserError as exc:
        raise invalid(f"Malformed multipart body: {exc}", param=None, code="invalid_multipart") from exc
    await _store(form, piece, last=True)


async def _store(form: UploadForm, piece: bytearray, *, last: bool = False) -> None:
    """Write a piece of the file part and check it, in a worker thread."""
    writer, checker = form.file, form.checker
    if writer is None or checker is None:
        return

    def store() -> None:
        writer.write(piece)
        checker.feed(bytes(piece))
        if last:
            checker.finish()

    await asyncio.to_thread(store)


def _too_large(limits: ValidationLimits) -> APIError:
    return APIError(
        413, f"The file exceeds the upload limit of {limits.max_file_bytes} bytes.", code="file_too_large", param="file"
    )
