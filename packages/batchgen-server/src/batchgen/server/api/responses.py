"""``/v1/responses``: OpenAI's Responses API. A response is answered now (whole, or streamed), or with
``background: true`` stored first and run as a one-line batch: the batch loop's durability is its durability (it
survives a crash or a restart and is answered exactly once), ``GET`` polls it and ``cancel`` cancels it.

A background response's batch and files live in a namespace of its tenant's own (``responses_owner``): they never
show among the tenant's batches and files, and another tenant finds none of them. They expire after
``RETENTION_S``, as OpenAI keeps a response for 30 days.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from litestar import Controller, Request, get, post
from litestar.response import Stream

from batchgen.schemas import (
    BatchInputLine,
    BatchObject,
    BatchRequestCounts,
    ErrorDetail,
    ErrorResponse,
    FileObject,
    Response,
    ResponseRequest,
    parse_output_line,
)
from batchgen.schemas.batches import MAX_EXPIRY_S

from ..batches.loop import CapacityExceeded
from ..ids import new_batch_id, new_file_id, new_request_id
from ..security.limits import is_valid_id
from ..serving.responses import pending_response
from .batches import queue_full
from .deps import ServerContext, now
from .errors import ERROR_RESPONSES, APIError, not_found
from .files import commit_file, read_content
from .online import prepare, serve

RETENTION_S = MAX_EXPIRY_S
"""How long a background response (its request and its answer) is kept: 30 days."""
_PREFIX, _BATCH_PREFIX = "resp_", "batch_"
_encode = msgspec.json.Encoder().encode


def responses_owner(owner: str) -> str:
    """Where a tenant's background responses are stored: apart from its own batches and files."""
    return f"{owner}/responses"


class ResponsesController(Controller):
    path = "/v1/responses"
    tags = ("responses",)

    @post(
        status_code=200,
        summary="Create a response: now (stream: true for server-sent events), or stored and run (background: true)",
        responses=ERROR_RESPONSES,
    )
    async def create(
        self, data: ResponseRequest, request: Request[Any, Any, Any], context: ServerContext, owner: str
    ) -> Response | Stream:
        if not data.background:
            response = await serve(context, request, data)
            assert isinstance(response, Response | Stream)
            return response
        if data.stream:
            raise APIError(
                400,
                "A background response cannot be streamed here: create it, then poll GET /v1/responses/{id}.",
                code="unsupported_parameter",
                param="stream",
            )
        return await _store(data, context, owner)

    @get("/{response_id:str}", summary="Retrieve a background response (poll this)", responses=ERROR_RESPONSES)
    async def retrieve(self, context: ServerContext, owner: str, response_id: str) -> Response:
        batch = None
        if (batch_id := _batch_id(response_id)) is not None:
            batch = await asyncio.to_thread(context.db.get_batch, batch_id, owner=responses_owner(owner))
        if batch is None:
            raise not_found("response", response_id)
        return await asyncio.to_thread(_response, context, batch, response_id)

    @post(
        "/{response_id:str}/cancel", status_code=200, summary="Cancel a background response", responses=ERROR_RESPONSES
    )
    async def cancel(self, context: ServerContext, owner: str, response_id: str) -> Response:
        batch = None
        if (batch_id := _batch_id(response_id)) is not None:
            batch = await asyncio.wrap_future(context.loop.cancel(batch_id, responses_owner(owner)))
        if batch is None:
            raise not_found("response", response_id)
        return await asyncio.to_thread(_response, context, batch, response_id)


def _batch_id(response_id: str) -> str | None:
    """The batch that runs a background response: the same token under the batch's prefix."""
    if not response_id.startswith(_PREFIX):
        return None
    batch_id = _BATCH_PREFIX + response_id.removeprefix(_PREFIX)
    return batch_id if is_valid_id(batch_id, "batch") else None


async def _store(body: ResponseRequest, context: ServerContext, owner: str) -> Response:
    """Check ``body`` as an online request is checked (a bad one is refused now, not failed later), then store it
    as a one-line batch and admit it: once this answers, the response runs, whatever happens to the server."""
    await prepare(context, body, new_request_id(), online=False, owner=owner)
    batch_id = new_batch_id()
    response_id = _PREFIX + batch_id.removeprefix(_BATCH_PREFIX)
    created_at = now()
    line = BatchInputLine(custom_id=response_id, method="POST", url="/v1/responses", body=body)
    content = _encode(line) + b"\n"
    file = FileObject(
        id=new_file_id(),
        bytes=len(content),
        created_at=created_at,
        filename=f"{response_id}.jsonl",
        purpose="batch",
        status="processed",
        expires_at=created_at + RETENTION_S,
    )
    tenant = responses_owner(owner)
    writer = context.blobs.new_upload()
    try:
        writer.write(content)
        await asyncio.to_thread(commit_file, context, writer, file, tenant, {"line_count": 1, "sequences": 1})
    except BaseException:
        await asyncio.shield(asyncio.to_thread(writer.discard))
        raise
    batch = BatchObject(
        id=batch_id,
        endpoint="/v1/responses",
        model=context.model.id,
        input_file_id=file.id,
        completion_window="24h",
        status="validating",
        created_at=created_at,
        expires_at=created_at + max(1, round(24 * context.settings.window_hour_s)),
        request_counts=BatchRequestCounts(total=1),
        metadata=body.metadata,
    )
    try:
        await asyncio.wrap_future(context.loop.admit(batch, tenant, 1, RETENTION_S))
    except CapacityExceeded as exc:
        await asyncio.to_thread(context.db.delete_file, file.id)
        context.blobs.delete(file.id)
        raise queue_full(exc, context) from None
    return pending_response(body, response_id.removeprefix(_PREFIX), "queued", created_at)


def _response(context: ServerContext, batch: BatchObject, response_id: str) -> Response:
    """The background response as its batch now has it: its answer once written, else cancelled, failed (its error
    line's error, or the batch's), or still pending."""
    body = _request(context, batch)
    response = pending_response(body, response_id.removeprefix(_PREFIX), "queued", batch.created_at)
    lines = [parse_output_line(raw) for raw in _results(context, batch)]
    for line in lines:
        if line.response is not None and isinstance(line.response.body, Response):
            answer = line.response.body
            answer.id, answer.created_at = response_id, batch.created_at
            return answer
    if batch.status in ("cancelling", "cancelled"):
        response.status = "cancelled"
    elif lines:
        [line] = lines
        response.status = "failed"
        if line.response is not None and isinstance(line.response.body, ErrorResponse):
            response.error = line.response.body.error
        else:
            message = line.error.message if line.error is not None else "The response failed."
            response.error = ErrorDetail(message=message, type="server_error", param=None, code="failed")
    elif batch.status in ("failed", "expired"):
        response.status = "failed"
        reason = batch.errors.data[0].message if batch.errors and batch.errors.data else None
        message = reason or f"The response {batch.status}."
        response.error = ErrorDetail(message=message, type="server_error", param=None, code=batch.status)
    else:
        response.status = "queued" if batch.status == "validating" else "in_progress"
    return response


def _results(context: ServerContext, batch: BatchObject) -> list[bytes]:
    """The lines written for the batch so far, answers and errors."""
    lines: list[bytes] = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None and (file := context.db.get_file(file_id, owner=None)) is not None:
            try:
                lines += b"".join(read_content(context, file)[1]).splitlines()
            except FileNotFoundError:  # dropped since it was looked up: the batch finished with nothing in it
                continue
    return lines


def _request(context: ServerContext, batch: BatchObject) -> ResponseRequest:
    file = context.db.get_file(batch.input_file_id, owner=None)
    if file is None:  # expired (its answer with it)
        raise not_found("response", _PREFIX + batch.id.removeprefix(_BATCH_PREFIX))
    return _LINE.decode(b"".join(read_content(context, file)[1])).body


class _StoredLine(msgspec.Struct):
    body: ResponseRequest


_LINE = msgspec.json.Decoder(_StoredLine)
