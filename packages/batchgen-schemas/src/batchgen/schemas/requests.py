"""Batch input lines ``{custom_id, method, url, body}`` and the typed request bodies of each endpoint.

msgspec allows one array-like type per union, so prompts/inputs that may be text, a list of texts, token ids or a
list of token-id lists are typed as ``str | list[str | int | list[int]]``; the validator checks that a list is
homogeneous.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ._base import Body

# Every number a request hands the engine is bounded here, so no value can overflow or exhaust it mid-batch.
INT32_MAX = 2**31 - 1
Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
TopP = Annotated[float, msgspec.Meta(gt=0, le=1)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)]
"""``-1`` or ``0`` disable top-k filtering (the vLLM convention); a value above the vocabulary keeps it all."""
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]
ChoiceCount = Annotated[int, msgspec.Meta(ge=1, le=128)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
"""A signed 64-bit integer, as OpenAI takes it."""
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]
Stop = str | Annotated[list[str], msgspec.Meta(max_length=4)]
Prompt = str | list[str | int | list[int]]


class TextContentPart(Body, kw_only=True, tag_field="type", tag="text"):
    text: str


class ChatMessage(Body, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text, with text parts joined as OpenAI does (no separator)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(Body, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(Body, kw_only=True):
    """Fields shared by the generating endpoints."""

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    n: ChoiceCount = 1
    ignore_eos: bool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool | None = None
    user: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Prompt
    logprobs: TopLogprobs | None = None
    echo: bool = False


class EmbeddingRequest(Body, kw_only=True):
    model: str
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)] | None = None
    user: str | None = None


RequestBody = ChatCompletionRequest | CompletionRequest | EmbeddingRequest


def count_sequences(prompt: object, n: object = 1) -> int:
    """The sequences a request asks the engine for: its prompts times ``n``. A text or a list of token ids is one
    prompt, a list of texts or of token-id lists one per item. Lenient, so that it also counts lines not yet
    validated (the upload check): anything else counts as one prompt, and an ``n`` that is not a positive int as 1.
    """
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return prompts * (n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1)


def sequences_of(body: RequestBody) -> int:
    """The work of a request, in the engine's sequences: what capacity and the engine's window count."""
    if isinstance(body, EmbeddingRequest):
        return count_sequences(body.input)
    return count_sequences(getattr(body, "prompt", None), body.n)


BODY_TYPES: dict[str, type[RequestBody]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}


class BatchInputLine(Body, kw_only=True):
    """One line of a batch input file, its body decoded into the type of its ``url``."""

    custom_id: str
    method: str
    url: str
    body: RequestBody
