"""``/v1/batches``: create (with backpressure), list, retrieve, cancel. The batch loop admits and cancels; the
database is read off the event loop."""

from __future__ import annotations

import asyncio
import re
from functools import partial
from typing import Annotated

from litestar import Controller, get, post
from litestar.params import Parameter

from batchgen.schemas import ENDPOINTS, BatchList, BatchObject, BatchRequestCounts, CreateBatchRequest

from ..batches.loop import CapacityExceeded
from ..callbacks import check_callback_metadata
from ..ids import new_batch_id
from ..security.limits import is_valid_id, validate_metadata
from ..serving import RequestRejected
from ..serving.structured import format_constraint
from .deps import ServerContext, now
from .errors import ERROR_RESPONSES, APIError, invalid, not_found
from .files import owned_file
from .idempotency import IDEMPOTENCY_KEY, idempotent

MIN_WINDOW_H, MAX_WINDOW_H = 24, 336
MAX_TOP_K = 1_000_000


def completion_window_hours(window: str) -> int:
    """``"24h"`` .. ``"336h"``, or whole days ``"1d"`` .. ``"14d"``."""
    match = re.fullmatch(r"([1-9][0-9]{0,3})([hd])", window)
    hours = 0 if match is None else int(match.group(1)) * (24 if match.group(2) == "d" else 1)
    if not MIN_WINDOW_H <= hours <= MAX_WINDOW_H:
        raise invalid(
            f"Invalid completion_window {window!r}: use whole hours from '24h' to '336h' or days such as '7d'.",
            param="completion_window",
        )
    return hours


async def owned_batch(context: ServerContext, batch_id: str, owner: str) -> BatchObject:
    batch = None
    if is_valid_id(batch_id, "batch"):
        batch = await asyncio.to_thread(context.db.get_batch, batch_id, owner=owner)
    if batch is None:
        raise not_found("batch", batch_id)
    return batch


class BatchesController(Controller):
    path = "/v1/batches"
    tags = ("batches",)

    @post(status_code=200, summary="Create a batch from an uploaded input file", responses=ERROR_RESPONSES)
    async def create(
        self,
        data: CreateBatchRequest,
        context: ServerContext,
        owner: str,
        idempotency_key: Annotated[str | None, Parameter(header=IDEMPOTENCY_KEY, required=False)] = None,
    ) -> BatchObject:
        async def create() -> BatchObject:
            return await _create_batch(data, context, owner)

        return await idempotent(
            context,
            owner,
            "batches",
            idempotency_key,
            create,
            lambda batch_id: context.db.get_batch(batch_id, owner=owner),
        )

    @get(summary="List batches, newest first", responses=ERROR_RESPONSES)
    async def list_batches(
        self,
        context: ServerContext,
        owner: str,
        limit: Annotated[int, Parameter(ge=1, le=100)] = 20,
        after: str | None = None,
    ) -> BatchList:
        batches, has_more = await asyncio.to_thread(context.db.list_batches, owner=owner, limit=limit, after=after)
        return BatchList(
            data=batches,
            first_id=batches[0].id if batches else None,
            last_id=batches[-1].id if batches else None,
            has_more=has_more,
        )

    @get("/{batch_id:str}", summary="Retrieve a batch (poll this for progress)", responses=ERROR_RESPONSES)
    async def retrieve(self, context: ServerContext, owner: str, batch_id: str) -> BatchObject:
        return await owned_batch(context, batch_id, owner)

    @post("/{batch_id:str}/cancel", status_code=200, summary="Cancel a batch", responses=ERROR_RESPONSES)
    async def cancel(self, context: ServerContext, owner: str, batch_id: str) -> BatchObject:
        batch = None
        if is_valid_id(batch_id, "batch"):
            batch = await asyncio.wrap_future(context.loop.cancel(batch_id, owner))
        if batch is None:
            raise not_found("batch", batch_id)
        if batch.status not in ("cancelling", "cancelled"):
            raise APIError(
                409, f"Cannot cancel batch {batch_id!r}: its status is {batch.status!r}.", code="batch_not_cancellable"
            )
        return batch


async def _create_batch(data: CreateBatchRequest, context: ServerContext, owner: str) -> BatchObject:
    if data.endpoint not in ENDPOINTS:
        raise invalid(f"Invalid endpoint {data.endpoint!r}: use one of {', '.join(ENDPOINTS)}.", param="endpoint")
    try:
        context.serving.check_endpoint(data.endpoint)
    except RequestRejected as exc:
        raise invalid(exc.message, param="endpoint", code=exc.code) from None
    window_s = max(1, round(completion_window_hours(data.completion_window) * context.settings.window_hour_s))
    validate_metadata(data.metadata)
    check_callback_metadata(data.metadata, context.settings.callbacks)
    max_context = context.model.max_context_length
    for param, value in (
        ("max_context_length", data.max_context_length),
        ("max_decoding_length", data.max_decoding_length),
    ):
        if value is not None and value > max_context:
            raise invalid(f"{param} {value} exceeds the model's maximum of {max_context} tokens.", param=param)
    if data.top_k is not None and data.top_k > MAX_TOP_K:
        raise invalid(f"top_k must be at most {MAX_TOP_K}.", param="top_k")
    if data.response_format is not None:
        try:  # compiled here once, and cached for the batch's lines
            await context.preparations.run(owner, partial(format_constraint, data.response_format))
        except RequestRejected as exc:
            raise invalid(exc.message, param=exc.param, code=exc.code) from None
    file = await owned_file(context, data.input_file_id, owner)
    if file.purpose != "batch":
        raise invalid(
            f"File {file.id!r} has purpose {file.purpose!r}; a batch needs a 'batch' file.", param="input_file_id"
        )
    requests, sequences = await asyncio.to_thread(context.db.file_work, file.id)
    created_at = now()
    batch = BatchObject(
        id=new_batch_id(),
        endpoint=data.endpoint,
        model=context.model.id,
        input_file_id=file.id,
        completion_window=data.completion_window,
        status="validating",
        created_at=created_at,
        expires_at=created_at + window_s,
        request_counts=BatchRequestCounts(total=requests),
        metadata=data.metadata,
        max_decoding_length=data.max_decoding_length,
        max_context_length=data.max_context_length,
        temperature=data.temperature,
        top_p=data.top_p,
        top_k=data.top_k,
        response_format=data.response_format,
    )
    try:
        expiry = None if data.output_expires_after is None else data.output_expires_after.seconds
        return await asyncio.wrap_future(context.loop.admit(batch, owner, sequences, expiry))
    except CapacityExceeded as exc:
        if exc.too_large:
            raise invalid(
                f"The file asks for {exc.requested} sequences (prompts x n), more than the server's capacity of "
                f"{exc.capacity}; split it.",
                param="input_file_id",
                code="batch_too_large",
            ) from None
        raise queue_full(exc, context) from None


def queue_full(exc: CapacityExceeded, context: ServerContext) -> APIError:
    """The 429 of work the batch loop has no room for now, with when to retry."""
    return APIError(
        429,
        f"The server is busy: {exc.queued} sequences are queued and the capacity is {exc.capacity}. Retry later.",
        code="queue_full",
        headers={"Retry-After": str(context.settings.retry_after_s)},
    )
