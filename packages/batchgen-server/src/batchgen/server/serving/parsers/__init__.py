"""A model's generated text split into OpenAI's shapes, as vLLM's ``--tool-call-parser`` and ``--reasoning-parser``
split it: tool calls from the content, reasoning from the answer. Pure text; streamed and whole text alike."""

from .reasoning import REASONING_PARSERS, ReasoningDelta, ReasoningParser, reasoning_parser
from .tool_calls import (
    TOOL_CALL_PARSERS,
    ParsedDelta,
    ToolCallDelta,
    ToolCallParser,
    parse_tool_calls,
    tool_call_parser,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ParsedDelta",
    "ReasoningDelta",
    "ReasoningParser",
    "ToolCallDelta",
    "ToolCallParser",
    "parse_tool_calls",
    "reasoning_parser",
    "tool_call_parser",
]
