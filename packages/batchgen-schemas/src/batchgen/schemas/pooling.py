"""Pooling endpoints' bodies in vLLM's shapes: ``/v1/score`` (text_1/text_2, queries/documents, data_1/data_2,
queries/items), ``/v1/rerank`` (``/rerank``, ``/v2/rerank``: Jina's and Cohere's query + documents), ``/classify``
and ``/pooling``; their requests and their responses."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ._base import Wire
from .requests import INT32_MAX, Prompt, RequestFields, Unsupported, count_sequences

TruncatePromptTokens = Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)]
"""vLLM's: keep a prompt's first ``k`` tokens (a pair's longest part is cut first); ``-1``: the model's context."""

ScoreInput = str | Annotated[list[str], msgspec.Meta(min_length=1)]
"""A text, or a non-empty list of texts."""

MAX_POOLING_INPUTS = 1024
"""Most documents (pairs, inputs) one pooling request may carry; more is refused (400 ``too_many_inputs``): split
them, or send them as a batch. The cap keeps one request from holding the engine and its answer in memory."""


class PoolingFields(RequestFields, kw_only=True):
    """Fields every pooling endpoint takes (vLLM's)."""

    truncate_prompt_tokens: TruncatePromptTokens | None = None
    use_activation: bool | None = None
    """Scores through the model's activation (sigmoid, softmax); ``false``: its raw values."""


SCORE_SPELLINGS = (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2"), ("queries", "items"))
"""vLLM's names of a score request's two sides."""


class ScoreRequest(PoolingFields, kw_only=True):
    """One text against one or many (``text_1`` a text, ``text_2`` a list), or pairs (two lists of one length)."""

    text_1: ScoreInput | None = None
    text_2: ScoreInput | None = None
    queries: ScoreInput | None = None
    documents: ScoreInput | None = None
    data_1: ScoreInput | None = None
    data_2: ScoreInput | None = None
    items: ScoreInput | None = None
    instruction: str | None = None
    """A reranker's task instruction (Qwen3-Reranker's ``<Instruct>``)."""
    max_tokens_per_query: Unsupported = None
    max_tokens_per_doc: Unsupported = None
    chat_template_kwargs: Unsupported = None

    def sides(self) -> tuple[tuple[str, ScoreInput | None], tuple[str, ScoreInput | None]]:
        """The two sides, under the names the request used (the first spelling that is set)."""
        for first, second in SCORE_SPELLINGS:
            if getattr(self, first) is not None or getattr(self, second) is not None:
                return (first, getattr(self, first)), (second, getattr(self, second))
        return ("text_1", None), ("text_2", None)


class RerankRequest(PoolingFields, kw_only=True):
    query: str
    documents: ScoreInput
    top_n: Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)] = 0
    """The best ``top_n`` only (``0``: every document)."""
    return_documents: bool = True
    """Each result carries its document's text (Cohere's field; vLLM always does)."""
    instruction: str | None = None
    max_tokens_per_query: Unsupported = None
    max_tokens_per_doc: Unsupported = None
    chat_template_kwargs: Unsupported = None


class ClassificationRequest(PoolingFields, kw_only=True):
    input: Prompt


class PoolingRequest(PoolingFields, kw_only=True):
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)] | None = None
    task: Unsupported = None
    embed_dtype: Unsupported = None


PoolingBody = ScoreRequest | RerankRequest | ClassificationRequest | PoolingRequest


class PoolingUsage(Wire, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreData(Wire, kw_only=True):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(Wire, kw_only=True):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(Wire, kw_only=True):
    text: str


class RerankResult(Wire, kw_only=True):
    index: int
    document: RerankDocument | None
    relevance_score: float


class RerankUsage(Wire, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(Wire, kw_only=True):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
    """Most relevant first."""


class ClassificationData(Wire, kw_only=True):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(Wire, kw_only=True):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class PoolingData(Wire, kw_only=True):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(Wire, kw_only=True):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


PoolingResponseBody = ScoreResponse | RerankResponse | ClassificationResponse | PoolingResponse


def decode_pooling_body(raw: Any) -> PoolingResponseBody:
    """A pooling endpoint's 200 body from its JSON, told apart by its shape (they share ``object: "list"``)."""
    value = msgspec.json.decode(raw)
    first = (value.get("data") or [{}])[0] if isinstance(value, dict) else {}
    body_type: type[PoolingResponseBody]
    if isinstance(value, dict) and "results" in value:
        body_type = RerankResponse
    elif "probs" in first:
        body_type = ClassificationResponse
    elif first.get("object") == "pooling":
        body_type = PoolingResponse
    else:
        body_type = ScoreResponse
    return msgspec.convert(value, body_type)


def pairs_of(body: ScoreRequest | RerankRequest) -> tuple[list[str], list[str]]:
    """The (query, document) texts a score or rerank request scores, one pair each: one text against each of the
    other side's, or the two sides' texts in pairs. Call it once ``pooling_problem`` has passed the body."""
    if isinstance(body, RerankRequest):
        documents = [body.documents] if isinstance(body.documents, str) else body.documents
        return [body.query] * len(documents), documents
    (_, first), (_, second) = body.sides()
    left = [first] if isinstance(first, str) else list(first or [])
    right = [second] if isinstance(second, str) else list(second or [])
    if len(left) == 1:
        left = left * len(right)
    return left, right


def count_pooling_inputs(body: PoolingBody) -> int:
    """The engine requests a pooling body makes (pairs, inputs); lenient, as ``count_sequences`` is."""
    if isinstance(body, ScoreRequest | RerankRequest):
        sides = [body.documents] if isinstance(body, RerankRequest) else [side for _, side in body.sides()]
        return max((1 if isinstance(side, str) else len(side or []) for side in sides), default=1) or 1
    return count_sequences(body.input)


def pooling_problem(body: PoolingBody) -> tuple[str, str] | None:
    """What makes a pooling body invalid beyond its fields' types, as ``(field, problem)``."""
    if isinstance(body, RerankRequest):
        documents = [body.documents] if isinstance(body.documents, str) else body.documents
        if not documents:
            return "documents", "it must not be empty."
        return None
    if isinstance(body, ScoreRequest):
        (name_1, first), (name_2, second) = body.sides()
        for name, side in ((name_1, first), (name_2, second)):
            if side is None or (isinstance(side, list) and not side):
                return name, "it must be a text or a non-empty list of texts."
        count_1 = 1 if isinstance(first, str) else len(first or [])
        count_2 = 1 if isinstance(second, str) else len(second or [])
        if count_1 > 1 and count_1 != count_2:
            return name_2, f"it has {count_2} texts for {count_1} in '{name_1}': one text against many, or pairs."
        return None
    if isinstance(body.input, list) and not body.input:
        return "input", "it must not be empty."
    return None
