"""Response bodies of each endpoint and the output/error file lines that carry them."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from ._base import Wire
from .errors import ErrorResponse
from .pooling import PoolingResponseBody, decode_pooling_body
from .responses_api import Response

FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(Wire, kw_only=True):
    cached_tokens: int = 0


class CompletionTokensDetails(Wire, kw_only=True):
    reasoning_tokens: int = 0


class CompletionUsage(Wire, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = msgspec.field(default_factory=CompletionTokensDetails)


class TopLogprob(Wire, kw_only=True):
    token: str
    bytes: list[int] | None = None
    logprob: float


class TokenLogprob(Wire, kw_only=True):
    token: str
    bytes: list[int] | None = None
    logprob: float
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Wire, kw_only=True):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class FunctionCall(Wire, kw_only=True):
    name: str
    arguments: str
    """The arguments as JSON text (an object)."""


class ToolCall(Wire, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatCompletionMessage(Wire, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET
    """The calls the model made (``tools``); absent when it made none."""
    reasoning: str | msgspec.UnsetType | None = msgspec.UNSET
    """A reasoning model's thinking (with ``--reasoning-parser``; ``null`` when it did not think), vLLM's field."""
    reasoning_content: str | msgspec.UnsetType | None = msgspec.UNSET
    """The same, under the name much of the ecosystem still reads (DeepSeek's API, older vLLM)."""


class ChatCompletionChoice(Wire, kw_only=True):
    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(Wire, kw_only=True, tag_field="object", tag="chat.completion"):
    id: str
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
    """vLLM's; only when the request asks for ``prompt_logprobs``."""


class CompletionLogprobs(Wire, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    """``null`` only for an echoed prompt's first token (nothing precedes it)."""
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class PromptLogprob(Wire, kw_only=True):
    """vLLM's ``Logprob``: one token's logprob at a prompt position, its rank in the vocabulary (1: the likeliest)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's ``prompt_logprobs``: per prompt token, ``null`` for the first, then token id -> its logprob, for the prompt's
token and the top ones asked for."""


class CompletionChoice(Wire, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
    """vLLM's; only when the request asks for ``prompt_logprobs``."""


class TextCompletion(Wire, kw_only=True, tag_field="object", tag="text_completion"):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
    system_fingerprint: str | None = None


class Embedding(Wire, kw_only=True, tag_field="object", tag="embedding"):
    index: int
    embedding: list[float] | str
    """Floats, or a base64 string of little-endian float32 when ``encoding_format`` is ``base64``."""


class EmbeddingUsage(Wire, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Wire, kw_only=True, tag_field="object", tag="list"):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


ResponseBody = ChatCompletion | TextCompletion | EmbeddingList | Response | ErrorResponse | PoolingResponseBody


class FunctionCallDelta(Wire, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Wire, kw_only=True, omit_defaults=True):
    """A piece of call ``index``: its first has the ``id``, ``type`` and name, the others more of the arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChoiceDelta(Wire, kw_only=True, omit_defaults=True):
    """What a stream chunk adds to a chat choice: the role first, then reasoning, content or tool calls; ``{}`` in the
    chunk that ends it."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatCompletionChunkChoice(Wire, kw_only=True):
    index: int
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(Wire, kw_only=True, tag_field="object", tag="chat.completion.chunk"):
    """One server-sent event of a streamed chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    system_fingerprint: str | None = None
    usage: CompletionUsage | msgspec.UnsetType | None = msgspec.UNSET
    """Sent only with ``stream_options.include_usage``: null, and the totals in a last chunk with no choices."""


class CompletionChunkChoice(Wire, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class TextCompletionChunk(Wire, kw_only=True, tag_field="object", tag="text_completion"):
    """One server-sent event of a streamed completion (OpenAI tags it ``text_completion`` too)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    system_fingerprint: str | None = None
    usage: CompletionUsage | msgspec.UnsetType | None = msgspec.UNSET


class BatchResponse(Wire, kw_only=True):
    status_code: int
    request_id: str
    body: ResponseBody


class BatchLineError(Wire, kw_only=True):
    code: str
    message: str


class BatchOutputLine(Wire, kw_only=True):
    """One line of a batch's output or error file."""

    id: str
    custom_id: str
    response: BatchResponse | None
    error: BatchLineError | None


class _RawResponse(msgspec.Struct):
    status_code: int
    request_id: str
    body: msgspec.Raw


class _RawOutputLine(msgspec.Struct):
    id: str
    custom_id: str
    response: _RawResponse | None = None
    error: BatchLineError | None = None


_SUCCESS_BODIES = msgspec.json.Decoder(ChatCompletion | TextCompletion | EmbeddingList | Response)
_ERROR_BODY = msgspec.json.Decoder(ErrorResponse)
_RAW_LINE = msgspec.json.Decoder(_RawOutputLine)


def _success_body(body: Any) -> Any:
    """A 200 body: by its ``object`` tag, else (a pooling endpoint's ``list``) by its shape."""
    try:
        return _SUCCESS_BODIES.decode(body)
    except msgspec.ValidationError:
        return decode_pooling_body(body)


def parse_output_line(line: bytes | str) -> BatchOutputLine:
    """Decode one output/error file line; the body type is chosen by its ``object`` tag or its ``error`` key."""
    raw = _RAW_LINE.decode(line)
    response = None
    if raw.response is not None:
        body: Any = raw.response.body
        decoded = _ERROR_BODY.decode(body) if raw.response.status_code >= 400 else _success_body(body)
        response = BatchResponse(status_code=raw.response.status_code, request_id=raw.response.request_id, body=decoded)
    return BatchOutputLine(id=raw.id, custom_id=raw.custom_id, response=response, error=raw.error)
