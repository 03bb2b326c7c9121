"""Batch input lines ``{custom_id, method, url, body}`` and the typed request bodies of each endpoint.

msgspec allows one array-like type per union, so prompts/inputs that may be text, a list of texts, token ids or a
list of token-id lists are typed as ``str | list[str | int | list[int]]``; the validator checks that a list is
homogeneous.

Every field OpenAI's API or vLLM's takes is declared, so that none passes silently: a field that is not declared is
an unknown parameter (refused when the body is decoded), and one declared ``Unsupported`` is refused by name when it
is set to anything but a value that changes nothing (``unsupported_parameter``). The rest are honoured, or are
no-ops here as they are at OpenAI (``user``, ``store``, ``metadata``, ``service_tier``, ...).
"""

from __future__ import annotations

import typing
from functools import cache
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
MinP = Annotated[float, msgspec.Meta(ge=0, le=1)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0, le=10)]
MinTokens = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
LogitBias = dict[str, Annotated[float, msgspec.Meta(ge=-100, le=100)]]
"""Token ids (as strings, OpenAI's shape) -> a bias added to their logits."""

Unsupported = Annotated[
    Any,
    msgspec.Meta(description="Not supported by batchgen: a request that sets it is refused (unsupported_parameter)."),
]
"""A field OpenAI or vLLM takes that batchgen does not honour (see ``unsupported_parameter``)."""


class TextContentPart(Body, kw_only=True, tag_field="type", tag="text"):
    text: str


class ImageUrl(Body, kw_only=True, forbid_unknown_fields=True):
    url: str
    """A ``data:image/...;base64,`` URL, or ``https://`` on a host ``--allowed-media-domains`` lists (a
    ``file://`` path under ``--allowed-local-media-path``, in run-batch)."""
    detail: Literal["auto", "low", "high"] | None = None
    """OpenAI's resolution hint; the model's image processor decides the resolution here, so it changes nothing."""


class ImageContentPart(Body, kw_only=True, tag_field="type", tag="image_url"):
    image_url: ImageUrl


class FileRef(Body, kw_only=True, forbid_unknown_fields=True):
    file_id: str | None = None
    """An image uploaded through ``POST /v1/files`` (purpose ``vision`` or ``user_data``)."""
    file_data: str | None = None
    """The file itself as a ``data:`` URL."""
    filename: str | None = None


class FileContentPart(Body, kw_only=True, tag_field="type", tag="file"):
    """OpenAI's ``file`` part: here an image, by the ``file_id`` of an upload (one picture, many lines)."""

    file: FileRef


ContentPart = TextContentPart | ImageContentPart | FileContentPart


class ChatMessage(Body, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant's calls of ``tools``, as OpenAI returns them."""
    tool_call_id: str | None = None
    """A ``tool`` message: the call it answers."""

    def text(self) -> str:
        """The message's text, with text parts joined as OpenAI does (no separator)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextContentPart))

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(not isinstance(part, TextContentPart) for part in self.content)


class JsonSchemaFormat(Body, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    """The JSON schema every output follows (``None``: any JSON value)."""
    strict: bool | None = None
    """``true``: a schema keyword the grammar cannot enforce refuses the request (the output is guaranteed to
    validate); otherwise such a keyword is ignored and the rest of the schema enforced."""


class ResponseFormat(Body, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Body, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs``: exactly one constraint, enforced token by token."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (an object, or its text); keywords the grammar cannot enforce refuse the request."""
    regex: str | None = None
    choice: Annotated[list[str], msgspec.Meta(min_length=1)] | None = None
    grammar: str | None = None
    """A context-free grammar: Lark (llguidance's dialect) or GBNF (llama.cpp's)."""
    json_object: bool | None = None
    structural_tag: str | None = None
    """``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`` as JSON text: free text in which each
    structure, once its trigger appears, follows its schema."""
    disable_any_whitespace: bool = False
    """JSON without optional whitespace (compact)."""
    whitespace_pattern: str | None = None
    """A regex for JSON's optional whitespace (default: at most a few spaces, tabs and newlines at each place)."""
    disable_fallback: bool = False
    """A no-op: there is one grammar backend, and no fallback."""
    disable_additional_properties: bool = False
    """vLLM's switch that closes the objects of a ``json`` schema: an object that lists ``properties`` takes no
    other key unless the schema says ``additionalProperties``. batchgen always does (as vLLM's default backend,
    xgrammar, does), so this changes nothing."""

    def constraints(self) -> list[str]:
        """The names of the constraints set."""
        return [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]


CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class FunctionDefinition(Body, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema (``None``: no arguments)."""
    strict: bool | None = None


class ChatTool(Body, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body, kw_only=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Body, kw_only=True, forbid_unknown_fields=True):
    """Call this function (its arguments follow its ``parameters``)."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(Body, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    """A last chunk with the usage (and ``"usage": null`` in the others)."""
    continuous_usage_stats: bool = False
    """vLLM's: the usage so far in every chunk."""


class RequestFields(Body, kw_only=True, forbid_unknown_fields=True):
    """Fields every endpoint takes."""

    model: str
    user: str | None = None
    """A no-op (OpenAI uses it to monitor abuse)."""
    add_special_tokens: bool | None = None
    """vLLM's: the tokenizer's special tokens (BOS...) around text prompts (default: on, off for a chat prompt)."""
    truncate_prompt_tokens: Unsupported = None
    priority: Unsupported = None
    request_id: Unsupported = None
    cache_salt: Unsupported = None
    mm_processor_kwargs: Unsupported = None
    kv_transfer_params: Unsupported = None
    vllm_xargs: Unsupported = None


class SamplingFields(RequestFields, kw_only=True):
    """Fields shared by the generating endpoints (with vLLM's sampling extensions)."""

    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    n: ChoiceCount = 1
    ignore_eos: bool = False
    min_tokens: MinTokens | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    skip_special_tokens: bool = True
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    """``json_schema`` or ``json_object``: every output is JSON (of the schema), enforced token by token."""
    structured_outputs: StructuredOutputs | None = None
    best_of: Unsupported = None
    use_beam_search: Unsupported = None
    length_penalty: Unsupported = None
    include_stop_str_in_output: Unsupported = None
    spaces_between_special_tokens: Unsupported = None
    prompt_logprobs: TopLogprobs | None = None
    """vLLM's: the prompt's own logprobs, each with this many top logprobs (``prompt_logprobs`` in the response)."""
    allowed_token_ids: Unsupported = None
    bad_words: Unsupported = None
    echo: Unsupported = None
    logits_processors: Unsupported = None
    return_tokens_as_token_ids: Unsupported = None
    return_token_ids: Unsupported = None
    guided_json: Unsupported = None
    guided_regex: Unsupported = None
    guided_choice: Unsupported = None
    guided_grammar: Unsupported = None
    guided_decoding_backend: Unsupported = None
    guided_whitespace_pattern: Unsupported = None
    structural_tag: Unsupported = None
    """vLLM's older spelling: ``structured_outputs.structural_tag``."""


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[ChatTool] | None = None
    """Rendered into the prompt by the model's chat template."""
    tool_choice: ToolChoice | None = None
    """``none`` leaves the tools out; ``auto`` (the default with tools) lets the model call them, parsed by the
    server's ``--tool-call-parser``; ``required`` and a named function are enforced by a grammar."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Variables for the chat template (``enable_thinking``...)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    parallel_tool_calls: bool | None = None
    """``false``: at most one call (enforced with ``tool_choice`` ``required``)."""
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    safety_identifier: str | None = None
    audio: Unsupported = None
    modalities: Unsupported = None
    prediction: Unsupported = None
    reasoning_effort: Unsupported = None
    verbosity: Unsupported = None
    web_search_options: Unsupported = None
    moderation: Unsupported = None
    functions: Unsupported = None
    function_call: Unsupported = None
    documents: Unsupported = None
    chat_template: Unsupported = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Prompt
    max_tokens: Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)] | None = None
    """``0`` only with ``echo``: the prompt scored, nothing generated."""
    logprobs: TopLogprobs | None = None
    echo: bool | None = None
    """The prompt's tokens (and with ``logprobs`` their logprobs, the first ``null``) ahead of the completion's."""
    suffix: Unsupported = None
    prompt_embeds: Unsupported = None


class EmbeddingRequest(RequestFields, kw_only=True):
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)] | None = None
    """Matryoshka: the first ``dimensions`` values (normalized again where the model normalizes)."""
    prompt_name: str | None = None
    """batchgen's: the instruction prefix the model's sentence-transformers config names so (``query``...), put
    before each input, as ``SentenceTransformer.encode(prompt_name=...)`` does (default: its default prompt)."""
    normalize: Unsupported = None
    embed_dtype: Unsupported = None
    additional_data: Unsupported = None


NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "modalities": (["text"],),
    "echo": (False,),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "include_stop_str_in_output": (False,),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "normalize": (True,),
    "priority": (0,),
    "suffix": ("",),
    "include": ([],),
    "top_logprobs": (0,),
    "truncation": ("disabled",),
}
"""Values of ``Unsupported`` fields that change nothing here (what clients send as defaults), besides ``null``."""


def unsupported_parameter(body: Body) -> str | None:
    """The first field of ``body`` that batchgen does not support, set to a value that would change the output (a
    ``best_of`` equal to ``n`` changes nothing); ``None`` if there is none."""
    for name in _unsupported_fields(type(body)):
        value = getattr(body, name)
        if value is None or value in NO_OP_VALUES.get(name, ()):
            continue
        if name == "best_of" and value == getattr(body, "n", 1):
            continue
        return name
    return None


@cache
def _unsupported_fields(body_type: type[Body]) -> tuple[str, ...]:
    hints = typing.get_type_hints(body_type, include_extras=True)
    return tuple(name for name, hint in hints.items() if hint == Unsupported)


def count_sequences(prompt: object, n: object = 1) -> int:
    """The sequences a request asks the engine for: its prompts times ``n``. A text or a list of token ids is one
    prompt, a list of texts or of token-id lists one per item. Lenient, so that it also counts lines not yet
    validated (the upload check): anything else counts as one prompt, and an ``n`` that is not a positive int as 1.
    """
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return prompts * (n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1)
