"""A chat request's prompt: its messages, tools and template variables rendered by the tokenizer's chat template.

Nothing is dropped silently: tools or a template variable that the template never mentions are refused, as is a
``tool_choice`` that needs guided decoding.
"""

from __future__ import annotations

import json
from typing import Any

from batchgen.schemas import ChatCompletionRequest, ChatMessage

from .errors import RequestRejected

RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""Arguments of ``apply_chat_template`` itself, or request fields of their own: not template variables."""


def render_chat(tokenizer: Any, body: ChatCompletionRequest, model: str) -> str:
    """The prompt text of ``body``; ``RequestRejected`` when the template cannot render it as asked."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise RequestRejected("unsupported_endpoint", f"model {model!r} has no chat template", "messages")
    source = template if isinstance(template, str) else "\n".join(template.values())  # named templates
    tools, variables = _tools(body, source), _variables(body, source)
    try:
        return str(
            tokenizer.apply_chat_template(
                [_message(m) for m in body.messages],
                tools=tools,
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                **variables,
            )
        )
    except Exception as exc:  # the template itself may reject a conversation (e.g. roles out of order)
        raise RequestRejected("invalid_value", f"chat template rejected the messages: {exc}", "messages") from exc


def _tools(body: ChatCompletionRequest, source: str) -> list[dict[str, Any]] | None:
    if body.tool_choice not in (None, "auto", "none"):
        raise RequestRejected(
            "unsupported_parameter",
            f"tool_choice {body.tool_choice!r} needs guided decoding, which batchgen does not have yet: use 'auto' "
            "(the template renders the tools and the model may call one, in its text) or 'none'",
            "tool_choice",
        )
    if not body.tools or body.tool_choice == "none":
        return None
    if "tools" not in source:
        raise RequestRejected("unsupported_parameter", "the model's chat template does not render tools", "tools")
    return body.tools


def _variables(body: ChatCompletionRequest, source: str) -> dict[str, Any]:
    variables = body.chat_template_kwargs or {}
    for name in variables:
        if name in RESERVED_KWARGS:
            raise RequestRejected(
                "invalid_value",
                f"chat_template_kwargs may not set {name!r}: it is not a template variable"
                + (" (set the request field instead)" if name in ChatCompletionRequest.__struct_fields__ else ""),
                "chat_template_kwargs",
            )
        if name not in source:
            raise RequestRejected(
                "unsupported_parameter",
                f"the model's chat template does not use the variable {name!r}",
                f"chat_template_kwargs.{name}",
            )
    return variables


def _message(message: ChatMessage) -> dict[str, Any]:
    """The message as chat templates read it: text content, and tool calls' arguments as objects (OpenAI sends them
    as JSON text; templates such as Qwen's and Llama's render them with ``tojson``)."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls is not None:
        rendered["tool_calls"] = [_parsed_arguments(call) for call in message.tool_calls]
    return rendered


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call  # not JSON: the template gets the text as sent
    return {**call, "function": {**function, "arguments": arguments}}
