"""``POST /v1/inference``: the removed direct-inference endpoint answers 410 and points to the batch API."""

from __future__ import annotations

from typing import Any

from litestar import Request, post
from litestar.openapi import ResponseSpec

from batchgen.schemas import ErrorResponse

from .errors import ERROR_RESPONSES, APIError


@post(
    "/v1/inference",
    status_code=410,
    tags=["legacy"],
    summary="Removed: use the batch API",
    include_in_schema=False,  # a removed endpoint is no part of the API
    responses={
        **ERROR_RESPONSES,
        410: ResponseSpec(
            ErrorResponse, description="Removed: the error points to the batch API", generate_examples=False
        ),
    },
)
async def legacy_inference(request: Request[Any, Any, Any]) -> None:
    raise APIError(
        410,
        "POST /v1/inference has been removed. Upload a JSONL file with POST /v1/files (purpose 'batch'), "
        "create a batch with POST /v1/batches and download its output_file_id from GET /v1/files/{id}/content.",
        code="endpoint_removed",
    )
