"""OpenAI's Responses API (``/v1/responses``): its request body, the ``response`` object and its stream's events,
as the ``openai`` SDK types them.

The server answers a response request through its chat path (a response is a chat completion said in other words),
so the fields here are those that map onto a chat request; every other field OpenAI defines is declared
``Unsupported`` and refused by name, as on the other endpoints.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from ._base import Body, Wire
from .batches import OutputTokensDetails
from .errors import ErrorDetail
from .requests import (
    ChatCompletionRequest,
    LogitBias,
    MaxTokens,
    MinP,
    Penalty,
    RepetitionPenalty,
    Seed,
    Stop,
    StructuredOutputs,
    Temperature,
    TokenId,
    TopK,
    TopP,
    Unsupported,
)


class InputContent(Body, kw_only=True, forbid_unknown_fields=True):
    """A part of an input message: ``input_text`` (``output_text`` in an assistant's, as responses return it;
    ``refusal`` too), or ``input_image`` by ``image_url`` (a data URL, an allowed https URL) or ``file_id`` (an
    uploaded image)."""

    type: Literal["input_text", "output_text", "refusal", "input_image"]
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputItem(Body, kw_only=True):
    """One item of ``input``: a message (``type`` may be left out), a ``function_call`` the model made earlier, its
    ``function_call_output``, or an earlier ``reasoning`` item (left out of the prompt, as chat templates drop past
    thinking). One struct for all: which fields an item needs is checked by ``response_problem``."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContent] | None = None
    id: str | None = None
    status: str | None = None
    phase: str | None = None
    summary: list[Any] | None = None
    encrypted_content: str | None = None

    def text(self) -> str:
        """The text of a message's ``content`` or of a call's ``output``, its parts joined without separator."""
        value = self.content if self.type == "message" else self.output
        if value is None or isinstance(value, str):
            return value or ""
        return "".join(part.text or part.refusal or "" for part in value)


class TextFormat(Body, kw_only=True, forbid_unknown_fields=True):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its schema (flat, unlike chat's)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Body, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: Unsupported = None


class FunctionTool(Body, kw_only=True):
    """A tool: only ``function`` runs here (the built-in tools, ``web_search`` and the rest, are OpenAI's own)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(Body, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


ResponseToolChoice = Literal["none", "auto", "required"] | FunctionToolChoice


class ResponseRequest(Body, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/responses`` (and of a ``/v1/responses`` batch line)."""

    model: str
    input: str | Annotated[list[InputItem], msgspec.Meta(min_length=1)]
    instructions: str | None = None
    """A system message ahead of ``input``."""
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ResponseToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    skip_special_tokens: bool | None = None
    structured_outputs: StructuredOutputs | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's extensions, as its Responses API takes them: what a chat request takes under the same names."""
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    """OpenAI's ``include_obfuscation``: a no-op (no obfuscation padding is sent)."""
    background: bool | None = None
    """Stored before it is answered (``queued``), run like a batch line, polled with ``GET /v1/responses/{id}``."""
    store: bool | None = None
    """A no-op: a background response is always stored, any other never (see the API reference)."""
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: Unsupported = None
    """``disabled`` only (a prompt over the context is refused), not ``auto`` (dropping input items)."""
    include: Unsupported = None
    """Nothing extra can be included (no logprobs, no encrypted reasoning): an empty list only."""
    top_logprobs: Unsupported = None
    reasoning: Unsupported = None
    previous_response_id: Unsupported = None
    conversation: Unsupported = None
    prompt: Unsupported = None
    max_tool_calls: Unsupported = None
    context_management: Unsupported = None
    moderation: Unsupported = None
    prompt_cache_options: Unsupported = None


class OutputText(Wire, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(Wire, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(Wire, kw_only=True, tag_field="type", tag="message"):
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCallItem(Wire, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    """The arguments as JSON text (an object)."""
    status: ItemStatus


class ReasoningItem(Wire, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    summary: list[Any] = msgspec.field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class ResponseInputTokensDetails(Wire, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    """Tokens written to an explicit prompt cache (OpenAI's ``prompt_cache_options``): none here."""


class ResponseUsage(Wire, kw_only=True):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Wire, kw_only=True):
    reason: Literal["max_output_tokens"]


ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


class Response(Wire, kw_only=True, tag_field="object", tag="response"):
    """The ``response`` object: what ``POST /v1/responses`` answers, ``GET /v1/responses/{id}`` polls, and a
    ``/v1/responses`` batch's output lines hold."""

    id: str
    created_at: int
    status: ResponseStatus
    background: bool = False
    completed_at: int | None = None
    error: ErrorDetail | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    model: str
    output: list[OutputItem] = msgspec.field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: None = None
    store: bool = False
    temperature: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


class ResponseEvent(Wire, kw_only=True, tag_field="type"):
    """One server-sent event of a streamed response; ``sequence_number`` counts them from 0."""

    sequence_number: int


class ResponseCreated(ResponseEvent, kw_only=True, tag="response.created"):
    response: Response


class ResponseInProgress(ResponseEvent, kw_only=True, tag="response.in_progress"):
    response: Response


class ResponseCompleted(ResponseEvent, kw_only=True, tag="response.completed"):
    response: Response


class ResponseIncomplete(ResponseEvent, kw_only=True, tag="response.incomplete"):
    response: Response


class ResponseFailed(ResponseEvent, kw_only=True, tag="response.failed"):
    response: Response


class OutputItemAdded(ResponseEvent, kw_only=True, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(ResponseEvent, kw_only=True, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(ResponseEvent, kw_only=True, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(ResponseEvent, kw_only=True, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(ResponseEvent, kw_only=True, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputTextDone(ResponseEvent, kw_only=True, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningTextDelta(ResponseEvent, kw_only=True, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(ResponseEvent, kw_only=True, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(ResponseEvent, kw_only=True, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(ResponseEvent, kw_only=True, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseErrorEvent(ResponseEvent, kw_only=True, tag="error"):
    code: str | None
    message: str
    param: str | None = None


class ResponseInputProblem(ValueError):
    """Why a response request cannot be said as a chat request: ``field`` (the response request's) and ``detail``."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"Invalid '{field}': {detail}")
        self.field, self.detail = field, detail


CHAT_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
"""A chat request's fields by the response request's that became them (the others keep their names)."""
_SAME_NAMES = (
    *("temperature", "top_p", "parallel_tool_calls", "metadata", "user", "stream", "safety_identifier", "top_k"),
    *("min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty"),
    *("repetition_penalty", "logit_bias", "skip_special_tokens", "structured_outputs", "chat_template_kwargs"),
)
"""The fields a response request and a chat request share."""
_CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
_encode = msgspec.json.Encoder().encode


class ChatTranslation(NamedTuple):
    """A response request as the chat request it runs as, and where each of that chat's messages came from."""

    chat: ChatCompletionRequest
    origins: tuple[str, ...]
    """Each chat message's field in the response request: ``instructions``, ``input`` or ``input[i]``."""

    def field(self, chat_field: str) -> str:
        """A field of the chat request (``messages[1].content[0].image_url.url``) as the response request's that
        became it (``input[0].content[0].image_url``)."""
        return response_field(chat_field, self.origins)


def chat_request(body: ResponseRequest) -> ChatCompletionRequest:
    """``body`` said as the chat request the server runs (``translate``)."""
    return translate(body).chat


def translate(body: ResponseRequest) -> ChatTranslation:
    """``body`` said as the chat request the server runs: ``instructions`` and ``input`` as messages (a function call
    as an assistant's ``tool_calls``, its output as a ``tool`` message; earlier reasoning left out), ``text.format``
    as ``response_format``, the function tools as chat tools. ``ResponseInputProblem`` names what does not fit."""
    messages: list[dict[str, Any]] = (
        [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    )
    origins = ["instructions"] * len(messages)
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        origins.append("input")
    else:
        for index, item in enumerate(body.input):
            said = _messages(item, f"input[{index}]", messages[-1] if messages else None)
            messages += said
            origins += [f"input[{index}]"] * len(said)
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    for name in _SAME_NAMES:
        if (value := getattr(body, name)) is not None:
            chat[name] = value
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.stream:
        chat["stream_options"] = {"include_usage": True}  # the usage of the completed response
    if body.text is not None and (form := body.text.format) is not None and form.type != "text":
        chat["response_format"] = _response_format(form)
    if body.tools:
        chat["tools"] = [_chat_tool(tool, f"tools[{index}]") for index, tool in enumerate(body.tools)]
    if isinstance(body.tool_choice, FunctionToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    try:
        return ChatTranslation(_CHAT_DECODER.decode(_encode(chat)), tuple(origins))
    except msgspec.ValidationError as exc:  # a value a chat request bounds (a function's name...)
        detail, _, path = str(exc).partition(" - at `$.")
        raise ResponseInputProblem(response_field(path.rstrip("`"), tuple(origins)), detail) from None


def _messages(item: InputItem, where: str, last: dict[str, Any] | None) -> list[dict[str, Any]]:
    if item.type == "message":
        if item.role is None:
            raise ResponseInputProblem(f"{where}.role", "a message needs a role.")
        if item.content is None:
            raise ResponseInputProblem(f"{where}.content", "a message needs content.")
        if isinstance(item.content, list) and any(part.type == "input_image" for part in item.content):
            return [{"role": item.role, "content": _chat_parts(item.content, f"{where}.content")}]
        return [{"role": item.role, "content": item.text()}]
    if item.type == "function_call":
        if item.call_id is None or item.name is None or item.arguments is None:
            raise ResponseInputProblem(where, "a function_call item needs call_id, name and arguments.")
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        if last is not None and last["role"] == "assistant":  # calls after the text, or after other calls: one turn
            last.setdefault("tool_calls", []).append(call)
            return []
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if item.type == "function_call_output":
        if item.call_id is None or item.output is None:
            raise ResponseInputProblem(where, "a function_call_output item needs call_id and output.")
        return [{"role": "tool", "tool_call_id": item.call_id, "content": item.text()}]
    return []  # reasoning: chat templates leave past thinking out


def _chat_parts(parts: list[InputContent], where: str) -> list[dict[str, Any]]:
    """A message with images, as chat content parts: ``input_image`` as ``image_url`` (a URL) or ``file`` (an
    upload's id), the text parts as text."""
    chat: list[dict[str, Any]] = []
    for index, part in enumerate(parts):
        if part.type != "input_image":
            chat.append({"type": "text", "text": part.text or part.refusal or ""})
        elif (part.image_url is None) == (part.file_id is None):
            raise ResponseInputProblem(
                f"{where}[{index}]", "an input_image needs exactly one of image_url and file_id."
            )
        elif part.image_url is not None:
            chat.append({"type": "image_url", "image_url": {"url": part.image_url, "detail": part.detail}})
        else:
            chat.append({"type": "file", "file": {"file_id": part.file_id}})
    return chat


def _response_format(form: TextFormat) -> dict[str, Any]:
    if form.type == "json_object":
        return {"type": "json_object"}
    if form.name is None:
        raise ResponseInputProblem("text.format.name", "it is required when 'type' is 'json_schema'.")
    schema: dict[str, Any] = {"name": form.name, "strict": form.strict, "description": form.description}
    if form.schema_ is not None:
        schema["schema"] = form.schema_
    return {"type": "json_schema", "json_schema": {key: value for key, value in schema.items() if value is not None}}


def _chat_tool(tool: FunctionTool, where: str) -> dict[str, Any]:
    if tool.type != "function":
        raise ResponseInputProblem(
            f"{where}.type", f"{tool.type!r} is one of OpenAI's built-in tools; only 'function' tools run here."
        )
    if tool.name is None:
        raise ResponseInputProblem(f"{where}.name", "a function tool needs a name.")
    function = {
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict,
    }
    return {"type": "function", "function": {key: value for key, value in function.items() if value is not None}}


_PART_FIELDS = ((".image_url.url", ".image_url"), (".file.file_id", ".file_id"), (".file.file_data", ""))
"""A chat image part's fields as an ``input_image``'s."""


def response_field(chat_field: str, origins: tuple[str, ...] = ()) -> str:
    """A chat request's field (``tools[0].function.name``) as the response request's that became it; ``origins``:
    where each chat message came from (``ChatTranslation``), so a message's field names its input item."""
    message = re.fullmatch(r"messages\[(\d+)\](.*)", chat_field)
    if message is not None and int(message[1]) < len(origins):
        rest = message[2]
        for chat_part, response_part in _PART_FIELDS:
            rest = rest.removesuffix(chat_part) + response_part if rest.endswith(chat_part) else rest
        return origins[int(message[1])] + rest
    name = re.match(r"[a-z_]*", chat_field).group()  # type: ignore[union-attr]  # it matches, if only ""
    if name in CHAT_FIELDS:
        return CHAT_FIELDS[name]
    return chat_field.replace(".function.", ".", 1) if name in ("tools", "tool_choice") else chat_field or "input"
