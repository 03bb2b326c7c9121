"""A chat choice's generated text as OpenAI's message, streamed or whole through one path: the reasoning split off
(``--reasoning-parser``), then the tool calls, parsed out of the text (``tool_choice: auto`` with
``--enable-auto-tool-choice --tool-call-parser``) or read from the JSON a forced call's grammar wrote (a named
function: its arguments; ``required``: a list of ``{"name", "parameters"}``, vLLM's shape). How a request's choices
are read (``MessagePlan``) is decided once, when it is prepared (``MessagePlanner``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from batchgen.schemas import (
    ChatCompletionMessage,
    ChatCompletionRequest,
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
)
from batchgen.schemas.responses import FinishReason

from ..ids import new_tool_call_id
from .config import ServingConfig
from .parsers import ReasoningParser, ToolCallParser, reasoning_parser, tool_call_parser
from .parsers.calls import dumps

PROMPT_TAIL_TOKENS = 32
"""The prompt's last tokens, as text, tell a reasoning parser whether the template opened or closed the thinking."""


@dataclass(frozen=True, slots=True)
class MessagePlan:
    """How the choices of one chat request are read (each by its own ``MessageReader``)."""

    prompt_tail: str
    """The end of the rendered prompt: it says whether the model starts inside its thinking."""
    reasoning: type[ReasoningParser] | None = None
    reasoning_end_ids: tuple[int, ...] = ()
    """The token ids of the end of the reasoning (``</think>``): the reasoning's tokens are those up to them."""
    tool_parser: type[ToolCallParser] | None = None
    tool_names: frozenset[str] = frozenset()
    forced: str | None = None
    """``required``, or the name of the function the request forces (its grammar wrote the arguments)."""

    @property
    def parses(self) -> bool:
        """A parser reads the text (reasoning, or tool calls)."""
        return self.reasoning is not None or self.tool_parser is not None

    @property
    def grammar_after(self) -> tuple[int, ...]:
        """A reasoning model's grammar constrains its answer, after its reasoning ends (as vLLM has it); from the
        first token when the prompt has closed the reasoning already (thinking disabled)."""
        if self.reasoning is None or self.prompt_tail.rstrip().endswith(self.reasoning.end):
            return ()
        return self.reasoning_end_ids


class MessagePlanner:
    """Plans how each chat request's choices are read, with the parsers the server was started with."""

    def __init__(self, tokenizer: Any, config: ServingConfig) -> None:
        self.tokenizer = tokenizer
        self.reasoning = None if config.reasoning_parser is None else reasoning_parser(config.reasoning_parser)
        """Splits a thinking model's reasoning from its answer (``--reasoning-parser``)."""
        self.tool_parser = None
        """Parses tool calls out of the text of a ``tool_choice: auto`` request (``--enable-auto-tool-choice``)."""
        if config.enable_auto_tool_choice and config.tool_call_parser is not None:
            self.tool_parser = tool_call_parser(config.tool_call_parser)
        self.reasoning_end_ids: tuple[int, ...] = ()
        if self.reasoning is not None:
            self.reasoning_end_ids = tuple(tokenizer.encode(self.reasoning.end, add_special_tokens=False))
        special = set(getattr(tokenizer, "all_special_tokens", ()))
        parsers = [parser for parser in (self.reasoning, self.tool_parser) if parser is not None]
        self.keep_special_tokens = any(marker in special for parser in parsers for marker in parser.markers)
        """A parser's marker is a special token: the text must keep them for the parser to see it."""

    def plan(self, body: ChatCompletionRequest, prompt: list[int]) -> MessagePlan:
        """How the choices of ``body`` (whose prompt is ``prompt``) are read."""
        forced: str | None = "required" if body.tools and body.tool_choice == "required" else None
        if isinstance(body.tool_choice, NamedToolChoice):
            forced = body.tool_choice.function.name
        parses_tools = body.tools and body.tool_choice in (None, "auto") and self.tool_parser is not None
        return MessagePlan(
            prompt_tail=str(self.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)),
            reasoning=self.reasoning,
            reasoning_end_ids=self.reasoning_end_ids,
            tool_parser=self.tool_parser if parses_tools else None,
            tool_names=frozenset(tool.function.name for tool in body.tools or ()),
            forced=forced,
        )


@dataclass(slots=True)
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class MessageReader:
    """Reads one choice's text as it comes (``read``, its last piece ``final``); ``message`` reads it whole."""

    def __init__(self, plan: MessagePlan) -> None:
        self.plan = plan
        self._reasoning = plan.reasoning(plan.prompt_tail) if plan.reasoning is not None else None
        self._tools = plan.tool_parser(plan.tool_names) if plan.tool_parser is not None else None
        self._forced_text: list[str] = []
        self._ids: list[str] = []
        """Each call's id, by its index."""
        self.reasoning_text = ""

    @property
    def called(self) -> bool:
        return bool(self._ids)

    def read(self, text: str, final: bool) -> MessageDelta:
        """What the next piece of text adds to the message; with ``final``, also what was held back."""
        delta = MessageDelta()
        if self._reasoning is not None:
            split = [self._reasoning.feed(text)] if text else []
            if final:
                split.append(self._reasoning.finish())
            delta.reasoning, text = "".join(s.reasoning for s in split), "".join(s.content for s in split)
            self.reasoning_text += delta.reasoning
        forced = self.plan.forced
        if forced == "required":
            self._forced_text.append(text)
            if final:
                self._required_calls("".join(self._forced_text), delta)
        elif forced is not None:  # the text is the call's arguments, streamed as they come
            if text or (final and not self._ids):
                delta.tool_calls.append(self._call_delta(0, None if self._ids else forced, text))
        elif self._tools is not None:
            parsed = [self._tools.feed(text)] if text else []
            if final:
                parsed.append(self._tools.finish())
            delta.content = "".join(p.content for p in parsed)
            delta.tool_calls = [self._call_delta(c.index, c.name, c.arguments) for p in parsed for c in p.tool_calls]
        else:
            delta.content = text
        return delta

    def _required_calls(self, text: str, delta: MessageDelta) -> None:
        """The list of calls the grammar wrote; cut short (the length limit), it stays text."""
        try:
            calls = json.loads(text)
            named = [(call["name"], dumps(call["parameters"])) for call in calls]
        except (ValueError, TypeError, KeyError):
            delta.content = text
            return
        for index, (name, arguments) in enumerate(named):
            delta.tool_calls.append(self._call_delta(index, name, arguments))

    def _call_delta(self, index: int, name: str | None, arguments: str) -> ToolCallDelta:
        first = index == len(self._ids)
        if first:
            self._ids.append(new_tool_call_id())
        return ToolCallDelta(
            index=index,
            id=self._ids[index] if first else None,
            type="function" if first else None,
            function=FunctionCallDelta(name=name, arguments=arguments),
        )

    def message(self, text: str) -> ChatCompletionMessage:
        """The whole text's message."""
        delta = self.read(text, final=True)
        calls: list[ToolCall] = []
        for piece in delta.tool_calls:
            function = piece.function
            if piece.id is not None:
                calls.append(ToolCall(id=piece.id, function=FunctionCall(name=function.name or "", arguments="")))
            calls[piece.index].function.arguments += function.arguments or ""
        message = ChatCompletionMessage(content=delta.content or None if calls else delta.content)
        if calls:
            message.tool_calls = calls
        if self._reasoning is not None:
            message.reasoning = message.reasoning_content = self.reasoning_text or None
        return message

    def finish_reason(self, engine_reason: FinishReason) -> FinishReason:
        """``tool_calls`` for a choice that stopped having called tools (a named function's call is an answer:
        ``stop``, as OpenAI has it)."""
        if engine_reason == "stop" and self._ids and self.plan.forced in (None, "required"):
            return "tool_calls"
        return engine_reason

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """How many of the choice's tokens are its reasoning: those up to the end of the reasoning, or all of them
        when it never ended."""
        if not self.reasoning_text:
            return 0
        end = self.plan.reasoning_end_ids
        for at in range(len(token_ids) - len(end) + 1):
            if tuple(token_ids[at : at + len(end)]) == end:
                return at + len(end)
        return len(token_ids)
