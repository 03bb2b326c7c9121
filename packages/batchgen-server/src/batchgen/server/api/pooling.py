"""Pooling endpoints in vLLM's shapes, answered now as the online endpoints are (``online.serve``): ``/v1/score``
(and ``/score``), ``/v1/rerank`` (and ``/rerank``, ``/v2/rerank``), ``/classify`` and ``/pooling``. The same bodies
run as batch lines under the same urls."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, post

from batchgen.schemas import (
    ClassificationRequest,
    ClassificationResponse,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)

from .deps import ServerContext
from .errors import ERROR_RESPONSES
from .online import serve


class PoolingController(Controller):
    tags = ("online",)

    @post(["/v1/score", "/score"], status_code=200, summary="Score text pairs now", responses=ERROR_RESPONSES)
    async def score(self, data: ScoreRequest, request: Request[Any, Any, Any], context: ServerContext) -> ScoreResponse:
        response = await serve(context, request, data)
        assert isinstance(response, ScoreResponse)
        return response

    @post(
        ["/v1/rerank", "/rerank", "/v2/rerank"],
        status_code=200,
        summary="Rank documents by relevance to a query now",
        responses=ERROR_RESPONSES,
    )
    async def rerank(
        self, data: RerankRequest, request: Request[Any, Any, Any], context: ServerContext
    ) -> RerankResponse:
        response = await serve(context, request, data)
        assert isinstance(response, RerankResponse)
        return response

    @post("/classify", status_code=200, summary="Classify texts now", responses=ERROR_RESPONSES)
    async def classify(
        self, data: ClassificationRequest, request: Request[Any, Any, Any], context: ServerContext
    ) -> ClassificationResponse:
        response = await serve(context, request, data)
        assert isinstance(response, ClassificationResponse)
        return response

    @post("/pooling", status_code=200, summary="The model's pooled output now", responses=ERROR_RESPONSES)
    async def pooling(
        self, data: PoolingRequest, request: Request[Any, Any, Any], context: ServerContext
    ) -> PoolingResponse:
        response = await serve(context, request, data)
        assert isinstance(response, PoolingResponse)
        return response
