"""A chat request's prompt: its messages, tools and template variables rendered by the tokenizer's chat template.

Nothing is dropped silently: tools or a template variable that the template never reads (jinja2's own analysis of
the template), assistant tool calls or tool results that it does not render (found once per template, by rendering
a probe conversation), are refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import msgspec

from batchgen.schemas import ChatCompletionRequest, ChatMessage, TextContentPart

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


def check_chat_template(tokenizer: Any, model: str, param: str | None = None) -> None:
    """400 ``unsupported_endpoint`` where the model has no chat template (it serves completions alone)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestRejected("unsupported_endpoint", f"model {model!r} has no chat template", param)


def render_chat(tokenizer: Any, body: ChatCompletionRequest, model: str) -> str:
    """The prompt text of ``body``; ``RequestRejected`` when the template cannot render it as asked."""
    check_chat_template(tokenizer, model, "messages")
    template = tokenizer.chat_template
    source = template if isinstance(template, str) else "\n".join(template.values())  # named templates
    facts = _facts(tokenizer, source)
    tools, variables = _tools(body, facts), _variables(body, facts)
    _check_messages(body, facts)
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
    except OSError:  # the machine's fault (no descriptor left, say), not the conversation's: not the request's error
        raise
    except Exception as exc:  # the template itself may reject a conversation (e.g. roles out of order)
        raise RequestRejected("invalid_value", f"chat template rejected the messages: {exc}", "messages") from exc


@dataclass(frozen=True, slots=True)
class _TemplateFacts:
    variables: frozenset[str]
    """What the template reads from its context (``messages``, ``tools``, ``enable_thinking``...)."""
    renders_tool_calls: bool
    renders_tool_results: bool


_PROBE_CALL, _PROBE_RESULT = "batchgen_probe_call", "batchgen probe result"
_PROBE = [
    {"role": "user", "content": "?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": _PROBE_CALL, "arguments": {}}}],
    },
    {"role": "tool", "tool_call_id": "call_0", "name": _PROBE_CALL, "content": _PROBE_RESULT},
]


@lru_cache(maxsize=16)
def _facts(tokenizer: Any, source: str) -> _TemplateFacts:
    try:
        variables = frozenset(jinja2.meta.find_undeclared_variables(_PARSER.parse(source)))
    except jinja2.TemplateSyntaxError:
        variables = frozenset()  # apply_chat_template fails on it too, and says why
    try:
        probe = str(tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=False))
    except Exception:  # a template that refuses tool messages refuses the request's too, and says why
        probe = f"{_PROBE_CALL} {_PROBE_RESULT}"
    return _TemplateFacts(variables, _PROBE_CALL in probe, _PROBE_RESULT in probe)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (marks assistant text), parsed as its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a mutable set)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


_PARSER = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, _GenerationTag])
"""Parses templates as transformers compiles them, for their variables only (it never renders)."""


def _check_messages(body: ChatCompletionRequest, facts: _TemplateFacts) -> None:
    for index, message in enumerate(body.messages):
        if message.tool_calls and not facts.renders_tool_calls:
            raise RequestRejected(
                "unsupported_parameter",
                "the model's chat template does not render an assistant message's tool_calls",
                f"messages[{index}].tool_calls",
            )
        if message.role == "tool" and not facts.renders_tool_results:
            raise RequestRejected(
                "unsupported_parameter",
                "the model's chat template does not render messages with the role 'tool'",
                f"messages[{index}].role",
            )


def _tools(body: ChatCompletionRequest, facts: _TemplateFacts) -> list[dict[str, Any]] | None:
    if not body.tools or body.tool_choice == "none":
        return None
    if "tools" not in facts.variables:
        raise RequestRejected("unsupported_parameter", "the model's chat template does not render tools", "tools")
    tools: list[dict[str, Any]] = msgspec.to_builtins(body.tools)
    return tools


def _variables(body: ChatCompletionRequest, facts: _TemplateFacts) -> dict[str, Any]:
    variables = body.chat_template_kwargs or {}
    for name in variables:
        if name in RESERVED_KWARGS:
            raise RequestRejected(
                "invalid_value",
                f"chat_template_kwargs may not set {name!r}: it is not a template variable"
                + (" (set the request field instead)" if name in ChatCompletionRequest.__struct_fields__ else ""),
                "chat_template_kwargs",
            )
        if name not in facts.variables:
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
    if message.has_images:  # parts, as processors' templates read them: an image marker where each picture goes
        rendered["content"] = [
            {"type": "text", "text": part.text} if isinstance(part, TextContentPart) else {"type": "image"}
            for part in message.content or ()
        ]
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
