"""Reasoning split from the answer: what a thinking model writes in ``<think>...</think>`` before it.

As with the tool-call parsers, one state machine serves streamed and whole text, so a stream's deltas add up to what
the whole text gives, and a tail that may be the start of a tag is held until it is decided. Whitespace next to the
tags is dropped: the reasoning is trimmed, the content after ``</think>`` starts at its first non-whitespace character
(vLLM keeps both; the models' chat templates trim them when they render the turn again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from .calls import marker_tail

__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "reasoning_parser"]


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    reasoning: str
    content: str


class ReasoningParser:
    """One choice's parser; a model's rules are the two class flags."""

    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    """Ends the reasoning: the caller tokenizes it to know when a grammar may start constraining the answer."""
    markers: ClassVar[tuple[str, ...]] = ("<think>", "</think>")
    """The special-token texts the parser must see in the text."""
    _prompt_opens: ClassVar[bool]
    """The template ends every prompt inside the block: the output is reasoning from its start."""
    _unclosed_is_reasoning: ClassVar[bool]
    """An output whose block never closes is reasoning (streamed as it comes), else all content (then the reasoning
    is held back until ``</think>`` decides it)."""

    def __init__(self, prompt_text: str) -> None:
        prompt = prompt_text.rstrip()
        self._state: Literal["opening", "reasoning", "content"] = "content" if prompt.endswith(self.end) else "opening"
        """``content`` from the start when the prompt closes the block already (thinking disabled)."""
        self._opened = self._prompt_opens or prompt.endswith(self.start)
        self._text = ""
        """Received and not given out yet."""
        self._opening = ""
        """The output's opening whitespace and ``<think>``: content after all if the block never closes."""
        self._trim = True
        """Leading whitespace of the part being given out (reasoning, then the answer after ``</think>``) is dropped."""

    def feed(self, text: str) -> ReasoningDelta:
        self._text += text
        return self._step(final=False)

    def finish(self) -> ReasoningDelta:
        return self._step(final=True)

    def _step(self, final: bool) -> ReasoningDelta:
        reasoning = ""
        if self._state == "opening":
            head = self._text.lstrip()
            if not final and self.start.startswith(head):  # "<think>" may still come
                return ReasoningDelta("", "")
            if head.startswith(self.start):
                opening = len(self._text) - len(head) + len(self.start)
                self._opening, self._text = self._text[:opening], self._text[opening:]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self._opened else "content"
                self._trim = self._opened
        if self._state == "reasoning":
            close = self._text.find(self.end)
            if close >= 0:
                reasoning = self._give(close, closes=True)
                self._text = self._text[len(self.end) :]
                self._state, self._trim = "content", True
            elif self._unclosed_is_reasoning:
                upto = len(self._text) if final else len(self._text[: marker_tail(self._text, self.markers)].rstrip())
                return ReasoningDelta(self._give(upto, closes=final), "")
            elif not final:
                return ReasoningDelta("", "")
            else:  # never closed: all content, as it came
                self._text, self._state, self._trim = self._opening + self._text, "content", False
        upto = len(self._text) if final else marker_tail(self._text, self.markers)
        return ReasoningDelta(reasoning, self._give(upto))

    def _give(self, upto: int, closes: bool = False) -> str:
        """The text up to ``upto``, which leaves the held text, trimmed as the part's."""
        piece, self._text = self._text[:upto], self._text[upto:]
        if self._trim:
            piece = piece.lstrip()
            self._trim = not piece
        return piece.rstrip() if closes else piece


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: ``<think>...</think>`` opens the output (or the prompt opens it, as the Thinking-2507 templates do); an
    output without it is all content. A block that never closes (cut off by ``max_tokens``) is reasoning, so that
    the reasoning streams as it comes: vLLM's qwen3 parser calls it content, and must then hold a stream's reasoning
    back until ``</think>``, minutes of silence for a long thought. A prompt that ends with a closed block
    (``enable_thinking=False``) makes all the output content."""

    _prompt_opens = False
    _unclosed_is_reasoning = True


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: its template ends the prompt with ``<think>\\n``, so the output is reasoning until ``</think>``
    (a ``<think>`` opening the output anyway is skipped; vLLM also drops any text before a later one), and an output
    that never closes it is all reasoning, as vLLM has it: the reasoning streams as it comes."""

    _prompt_opens = True
    _unclosed_is_reasoning = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class named ``name`` (vLLM's ``--reasoning-parser`` names); ValueError naming the valid names."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; valid: {', '.join(sorted(REASONING_PARSERS))}") from None
