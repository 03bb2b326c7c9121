"""The Responses API said through the chat path: a response request runs as the chat request it is
(``batchgen.schemas.responses_api.chat_request``), and its chat completion is said back as a ``response`` object:
the reasoning (with ``--reasoning-parser``), the message, then the function calls, each an output item."""

from __future__ import annotations

import time

import msgspec

from batchgen.schemas import (
    ChatCompletion,
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponseRequest,
    ResponseStatus,
    ResponseUsage,
)
from batchgen.schemas.batches import OutputTokensDetails
from batchgen.schemas.responses import CompletionUsage, FinishReason, ToolCall
from batchgen.schemas.responses_api import IncompleteDetails, ItemStatus, ResponseInputTokensDetails


def response_id(request_id: str) -> str:
    """``resp_<hex>`` for the request ``req_<hex>`` (or a background response's own token)."""
    return f"resp_{request_id.removeprefix('req_')}"


def message_item(request_id: str, text: str | None, status: ItemStatus = "completed") -> OutputMessage:
    """The message, with its text (``None``: a streamed one's opening, no content part yet)."""
    return OutputMessage(id=f"msg_{request_id}", status=status, content=[] if text is None else [OutputText(text=text)])


def reasoning_item(request_id: str, text: str | None, status: ItemStatus = "completed") -> ReasoningItem:
    content = [] if text is None else [ReasoningText(text=text)]
    return ReasoningItem(id=f"rs_{request_id}", content=content, status=status)


def call_item(request_id: str, call: ToolCall, status: ItemStatus = "completed") -> FunctionCallItem:
    return FunctionCallItem(
        id=f"fc_{call.id}", call_id=call.id, name=call.function.name, arguments=call.function.arguments, status=status
    )


def response_object(body: ResponseRequest, chat: ChatCompletion, request_id: str) -> Response:
    """The ``response`` of ``body``, from the chat completion it ran as."""
    choice = chat.choices[0]
    message = choice.message
    items: list[OutputItem] = []
    if isinstance(message.reasoning, str):
        items.append(reasoning_item(request_id, message.reasoning))
    calls = message.tool_calls if isinstance(message.tool_calls, list) else []
    if message.content or not calls:
        items.append(message_item(request_id, message.content or ""))
    items += [call_item(request_id, call) for call in calls]
    return finished_response(body, request_id, items, choice.finish_reason, chat.usage, chat.created)


def finished_response(
    body: ResponseRequest,
    request_id: str,
    items: list[OutputItem],
    finish_reason: FinishReason,
    usage: CompletionUsage | None,
    created_at: int,
) -> Response:
    """``body``'s response once generated: ``incomplete`` when ``max_output_tokens`` (or the context) cut it."""
    status: ResponseStatus = "incomplete" if finish_reason == "length" else "completed"
    response = pending_response(body, request_id, status, created_at)
    response.output = items
    response.completed_at = int(time.time()) if status == "completed" else None
    response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
    response.usage = None if usage is None else response_usage(usage)
    return response


def pending_response(body: ResponseRequest, request_id: str, status: ResponseStatus, created_at: int) -> Response:
    """``body``'s response with no output yet: what its request said, and ``status``."""
    return Response(
        id=response_id(request_id),
        created_at=created_at,
        status=status,
        background=bool(body.background),
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        metadata=body.metadata or {},
        model=body.model,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        store=bool(body.background),
        temperature=body.temperature,
        text={"format": msgspec.to_builtins(body.text.format)}
        if body.text and body.text.format
        else {"format": {"type": "text"}},
        tool_choice=msgspec.to_builtins(body.tool_choice) if body.tool_choice is not None else "auto",
        tools=[msgspec.to_builtins(tool) for tool in body.tools or ()],
        top_p=body.top_p,
        user=body.user,
    )


def response_usage(usage: CompletionUsage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=ResponseInputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=usage.completion_tokens_details.reasoning_tokens),
        total_tokens=usage.total_tokens,
    )
