"""What each endpoint a batch may target takes: its request body type, and the batch input line that carries one."""

from __future__ import annotations

from ._base import Body
from .pooling import (
    ClassificationRequest,
    PoolingBody,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    count_pooling_inputs,
)
from .requests import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, count_sequences
from .responses_api import ResponseRequest

RequestBody = (
    ChatCompletionRequest
    | CompletionRequest
    | EmbeddingRequest
    | ResponseRequest
    | ScoreRequest
    | RerankRequest
    | ClassificationRequest
    | PoolingRequest
)


def sequences_of(body: RequestBody) -> int:
    """The work of a request, in the engine's sequences: what capacity and the engine's window count."""
    if isinstance(body, EmbeddingRequest):
        return count_sequences(body.input)
    if isinstance(body, PoolingBody):
        return count_pooling_inputs(body)
    if isinstance(body, ResponseRequest):
        return 1
    return count_sequences(getattr(body, "prompt", None), body.n)


BODY_TYPES: dict[str, type[RequestBody]] = {
    "/v1/responses": ResponseRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/score": ScoreRequest,
    "/v1/rerank": RerankRequest,
    "/v2/rerank": RerankRequest,
    "/rerank": RerankRequest,
    "/score": ScoreRequest,
    "/classify": ClassificationRequest,
    "/pooling": PoolingRequest,
}


class BatchInputLine(Body, kw_only=True):
    """One line of a batch input file, its body decoded into the type of its ``url``."""

    custom_id: str
    method: str
    url: str
    body: RequestBody
