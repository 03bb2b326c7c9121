"""Tool-call parsers by their vLLM ``--tool-call-parser`` names, and whole-text parsing."""

from __future__ import annotations

from .calls import ParsedDelta, ToolCallDelta, ToolCallParser
from .json_calls import HermesToolParser, KimiK2ToolParser, Llama3JsonToolParser, MistralToolParser
from .pythonic import PythonicToolParser

__all__ = [
    "TOOL_CALL_PARSERS",
    "ParsedDelta",
    "ToolCallDelta",
    "ToolCallParser",
    "parse_tool_calls",
    "tool_call_parser",
]

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser,
    "kimi_k2": KimiK2ToolParser,
}
"""vLLM's names, its aliases for Llama 4 included."""


def tool_call_parser(name: str) -> type[ToolCallParser]:
    """The parser class named ``name``; ValueError naming the valid names."""
    try:
        return TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; valid: {', '.join(sorted(TOOL_CALL_PARSERS))}") from None


def parse_tool_calls(parser: ToolCallParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """Whole text -> (its content, None if empty or whitespace only; [(name, arguments JSON text)]), through ``feed``
    and ``finish`` as a stream goes."""
    deltas = (parser.feed(text), parser.finish())
    content = "".join(delta.content for delta in deltas)
    calls: dict[int, tuple[str, str]] = {}
    for call in (call for delta in deltas for call in delta.tool_calls):
        name, arguments = calls.get(call.index, ("", ""))
        calls[call.index] = (call.name or name, arguments + call.arguments)
    return (content if content.strip() else None), list(calls.values())
