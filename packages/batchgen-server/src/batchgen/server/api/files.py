"""``/v1/files``: upload, list, retrieve, delete and download."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Literal
from urllib.parse import quote

from litestar import Controller, Request, Response, delete, get, post
from litestar.openapi import ResponseSpec
from litestar.openapi.spec import (
    Encoding,
    OpenAPIFormat,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    RequestBody,
    Schema,
)
from litestar.params import Parameter
from litestar.response import Stream

from batchgen.schemas import FileDeleted, FileList, FileObject
from batchgen.schemas.batches import MAX_EXPIRY_S, MIN_EXPIRY_S

from ..ids import new_file_id
from ..media import MediaError, decoded, open_image
from ..media.files import IMAGE_PURPOSES
from ..security.limits import is_valid_id
from ..storage.blobs import ContentCorrupt, UploadWriter
from .deps import ServerContext, ensure_admitting, now
from .engine_calls import RETRY_AFTER_S
from .errors import ERROR_RESPONSES, APIError, invalid, not_found
from .idempotency import IDEMPOTENCY_KEY, idempotent
from .uploads import read_upload

JSONL = "application/jsonl"
log = logging.getLogger("batchgen.server.files")


@dataclass
class UploadOperation(Operation):
    """The multipart body of ``POST /v1/files`` as the OpenAPI document publishes it: the handler reads the stream
    itself (uploads.py), so Litestar cannot infer it, and without it the docs pages offer no file field."""

    def __post_init__(self) -> None:
        # The empty examples: Swagger UI fills each optional field with a sample ('created_at', 3600) and so would
        # make every upload from the docs page expire; blank fields are sent as no expiry (see _expires_at).
        form = Schema(
            type=OpenAPIType.OBJECT,
            required=["file", "purpose"],
            properties={
                "file": Schema(
                    type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY, description="The JSONL input file."
                ),
                "purpose": Schema(type=OpenAPIType.STRING, enum=["batch", "vision", "user_data"]),
                "expires_after[anchor]": Schema(
                    type=OpenAPIType.STRING,
                    enum=["created_at"],
                    examples=[""],
                    description="With 'expires_after[seconds]', the file is deleted; leave both out to keep it.",
                ),
                "expires_after[seconds]": Schema(
                    type=OpenAPIType.INTEGER,
                    minimum=MIN_EXPIRY_S,
                    maximum=MAX_EXPIRY_S,
                    examples=[""],
                    description="Seconds after the upload at which the file is deleted.",
                ),
            },
            dependent_required={
                "expires_after[anchor]": ["expires_after[seconds]"],
                "expires_after[seconds]": ["expires_after[anchor]"],
            },
        )
        media_type = OpenAPIMediaType(schema=form, encoding={"file": Encoding(content_type=JSONL)})
        self.request_body = RequestBody(content={"multipart/form-data": media_type}, required=True)
        # Litestar does not read this body (uploads.py does), so it does not document the answer to another kind.
        if self.responses is not None and isinstance(error := self.responses["400"], OpenAPIResponse):
            self.responses["415"] = OpenAPIResponse(
                description="The body is not multipart/form-data", content=error.content
            )


async def owned_file(context: ServerContext, file_id: str, owner: str) -> FileObject:
    file = None
    if is_valid_id(file_id, "file"):
        file = await asyncio.to_thread(context.db.get_file, file_id, owner=owner)
    if file is None or _expired(file):  # an expired file not yet swept is already gone
        raise not_found("file", file_id)
    return file


class FilesController(Controller):
    path = "/v1/files"
    tags = ("files",)

    @post(
        status_code=200,
        summary="Upload a JSONL input file (multipart: file, purpose)",
        responses=ERROR_RESPONSES,
        operation_class=UploadOperation,
    )
    async def upload(
        self,
        request: Request[Any, Any, Any],
        context: ServerContext,
        owner: str,
        idempotency_key: Annotated[str | None, Parameter(header=IDEMPOTENCY_KEY, required=False)] = None,
    ) -> FileObject:
        async def create() -> FileObject:
            return await _store_upload(request, context, owner)

        def lookup(file_id: str) -> FileObject | None:
            return context.db.get_file(file_id, owner=owner)

        return await idempotent(context, owner, "files", idempotency_key, create, lookup)

    @get(summary="List files, newest first by default", responses=ERROR_RESPONSES)
    async def list_files(
        self,
        context: ServerContext,
        owner: str,
        purpose: str | None = None,
        limit: Annotated[int, Parameter(ge=1, le=10000)] = 10000,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> FileList:
        files, has_more = await asyncio.to_thread(
            context.db.list_files, owner=owner, purpose=purpose, limit=limit, order=order, after=after
        )
        return FileList(
            data=files,
            first_id=files[0].id if files else None,
            last_id=files[-1].id if files else None,
            has_more=has_more,
        )

    @get("/{file_id:str}", summary="Retrieve a file's metadata", responses=ERROR_RESPONSES)
    async def retrieve(self, context: ServerContext, owner: str, file_id: str) -> FileObject:
        file = await owned_file(context, file_id, owner)
        if file.status == "uploaded":  # a results file of a running batch grows: its current size
            file.bytes = await asyncio.to_thread(context.blobs.complete_lines_length, file.id)
        return file

    @delete("/{file_id:str}", status_code=200, summary="Delete a file", responses=ERROR_RESPONSES)
    async def delete_file(self, context: ServerContext, owner: str, file_id: str) -> FileDeleted:
        await owned_file(context, file_id, owner)
        if not await asyncio.to_thread(_delete_unless_in_use, context, file_id):
            raise APIError(
                409,
                f"File {file_id!r} is in use by a batch that has not finished.",
                code="file_in_use",
                param="file_id",
            )
        return FileDeleted(id=file_id, deleted=True)

    @get(
        "/{file_id:str}/content",
        summary="Download a file's content (partial while its batch runs)",
        media_type=JSONL,
        responses={
            **ERROR_RESPONSES,
            200: ResponseSpec(str, description="The file's lines (JSONL)", media_type=JSONL, generate_examples=False),
        },
    )
    async def content(self, context: ServerContext, owner: str, file_id: str) -> Response[Any]:
        file = await owned_file(context, file_id, owner)
        try:
            # Opened and checked before answering: a missing or damaged blob is a clear error, not a 200 cut short.
            length, chunks = await asyncio.to_thread(read_content, context, file)
        except FileNotFoundError:
            raise APIError(
                500,
                f"The content of file {file_id!r} is missing from the server's storage.",
                code="file_content_missing",
            ) from None
        except ContentCorrupt as exc:
            log.error("file content not served: %s", exc)
            raise APIError(
                500,
                f"The content of file {file_id!r} in the server's storage is not what was stored (its size or "
                "checksum differs), so it is not served.",
                code="file_content_corrupt",
            ) from None
        return Stream(
            chunks,
            media_type=JSONL,
            headers={"Content-Disposition": content_disposition(file.filename), "Content-Length": str(length)},
        )


def content_disposition(filename: str) -> str:
    """``attachment`` with the name as RFC 6266 says: a quoted ASCII fallback, plus the exact name percent-encoded
    in UTF-8 (RFC 5987) when it is not plain ASCII (header values are Latin-1: ``文件.jsonl`` cannot go in raw).
    Stored names hold no quote, backslash or control character (``sanitize_filename``)."""
    fallback = filename.encode("ascii", "replace").decode("ascii").replace("?", "_")
    if fallback == filename:
        return f'attachment; filename="{filename}"'
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"


def read_content(context: ServerContext, file: FileObject) -> tuple[int, Iterator[bytes]]:
    """A results file still being appended to is served up to its last complete line; a finished file once its
    content is checked against its size and checksum."""
    if file.status == "uploaded":
        length = context.blobs.complete_lines_length(file.id)
        return length, context.blobs.read(file.id, length=length)
    return file.bytes, context.blobs.read_verified(file.id, size=file.bytes, checksum=file.checksum)


def _delete_unless_in_use(context: ServerContext, file_id: str) -> bool:
    if context.db.file_in_use(file_id):
        return False
    context.db.delete_file(file_id)
    context.blobs.delete(file_id)
    return True


async def _store_upload(request: Request[Any, Any, Any], context: ServerContext, owner: str) -> FileObject:
    settings = context.settings
    form = await read_upload(request, context.blobs, settings.validation_limits, settings.upload_idle_timeout_s)
    writer = form.file
    try:
        purpose = form.fields.get("purpose")
        if writer is None or form.checker is None:
            raise invalid("Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
        if purpose is None:
            raise invalid("Missing required parameter: 'purpose'.", param="purpose", code="missing_required_parameter")
        if purpose not in ("batch", *IMAGE_PURPOSES):
            raise invalid(
                f"Invalid purpose {purpose!r}: upload 'batch' files, or images as 'vision' or 'user_data'.",
                param="purpose",
            )
        created_at = now()
        expires_at = _expires_at(form.fields, created_at)
        if purpose != "batch":  # an image, which requests name by its id: it must read as one (its header)
            await context.preparations.run(owner, partial(_check_image, writer, context))
        elif form.check_error is not None:
            error = form.check_error
            where = f"line {error.line}: " if error.line is not None else ""
            raise APIError(422, f"Invalid input file, {where}{error.message}", code=error.code, param="file")
        ensure_admitting(request)  # a shutdown may have begun while the upload streamed in
        file = FileObject(
            id=new_file_id(),
            bytes=writer.size,
            created_at=created_at,
            filename=form.filename,
            purpose=purpose,  # type: ignore[arg-type]  # one of FilePurpose's, checked above
            status="processed",
            expires_at=expires_at,
            checksum=writer.checksum,
        )
        work = {"line_count": form.checker.requests, "sequences": form.checker.sequences} if purpose == "batch" else {}
        await asyncio.to_thread(commit_file, context, writer, file, owner, work)
    except BaseException:
        if writer is not None:
            await asyncio.shield(asyncio.to_thread(writer.discard))
        raise
    return file


def commit_file(
    context: ServerContext, writer: UploadWriter, file: FileObject, owner: str, work: dict[str, int]
) -> None:
    """The content durable under its id, then its row; on a failure (a full disk, even once the content is in place)
    neither is left behind."""
    try:
        writer.commit(file.id)
        context.db.insert_file(file, owner=owner, **work)
    except BaseException:
        context.blobs.delete(file.id)
        raise


def _check_image(writer: UploadWriter, context: ServerContext) -> None:
    """An image upload decodes within the limits requests' images have; else a 422 naming ``file``, as an input
    file whose content is invalid is."""
    images = context.serving.preparer.images
    limits = images.limits
    try:
        if writer.size > limits.max_image_bytes:
            raise MediaError("image_too_large", f"The image is over {limits.max_image_bytes} bytes.", "file")
        image = open_image(writer.written(), "file", limits)
        with images.budget.held(image.width * image.height, "file"):
            decoded(image, "file")
    except MediaError as exc:
        if exc.status_code == 429:  # no room to decode it now
            retry = {"Retry-After": str(RETRY_AFTER_S)}
            raise APIError(429, exc.message, code=exc.code, param="file", headers=retry) from None
        raise APIError(422, f"Invalid image: {exc.message}", code=exc.code, param="file") from None


def _expired(file: FileObject) -> bool:
    return file.expires_at is not None and file.expires_at <= now()


def _expires_at(fields: dict[str, str], created_at: int) -> int | None:
    # A blank field is no field: forms, the docs page's included, send the ones left empty.
    anchor, seconds = fields.get("expires_after[anchor]") or None, fields.get("expires_after[seconds]") or None
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise invalid("'expires_after[anchor]' must be 'created_at'.", param="expires_after[anchor]")
    try:
        value = int(seconds or "")
    except ValueError:
        value = -1
    if not MIN_EXPIRY_S <= value <= MAX_EXPIRY_S:
        raise invalid(
            f"'expires_after[seconds]' must be an integer from {MIN_EXPIRY_S} to {MAX_EXPIRY_S}.",
            param="expires_after[seconds]",
        )
    return created_at + value
