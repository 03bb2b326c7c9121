"""What every tool-call parser shares: the deltas it gives, and one state machine for streamed and whole text.

A parser holds the text it has received and not yet given out, and gives out what is decided: content up to where a
call may begin, and each call once its text is complete. It holds what is not decided yet: a tail that may be the
start of a marker, whitespace that may come before a call, a call whose text is still open. ``parse_tool_calls``
feeds the whole text at once through the same code, so a stream's deltas always add up to what the whole text gives.

A call is given out whole, its name and arguments in one delta, once its text is complete: only then is it known to
be a call (its JSON parses, its name is one of the request's tools), and a name given out earlier could not be taken
back from the client when the rest turns out malformed or is cut off by ``max_tokens``. Text that is not a call
stays in ``content``, markers and all, as vLLM leaves an unparsable call in the content. The whitespace the format
puts between the content and a call, between calls and after the last one is dropped (vLLM keeps some of it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    """The call's position among this choice's calls (0, 1, ...)."""
    name: str | None
    """Set on the call's first delta only."""
    arguments: str
    """The next piece of the arguments' JSON text ("" allowed)."""


@dataclass(frozen=True, slots=True)
class ParsedDelta:
    content: str
    """Plain text for the user (may be "")."""
    tool_calls: tuple[ToolCallDelta, ...] = ()


Call = tuple[str, str]
"""A call's name and its arguments as JSON object text."""


@dataclass(frozen=True, slots=True)
class Region:
    """``text[start:end]`` is one stretch of call syntax: its calls (none for a closing marker after a call), or None
    when it turned out not to be a call and is content."""

    start: int
    end: int
    calls: list[Call] | None


class ToolCallParser:
    """One choice's parser. A format implements ``_region``; the rest (holding, whitespace, deltas) is here."""

    markers: ClassVar[tuple[str, ...]] = ()
    """The special-token texts the format uses: the caller decodes with ``skip_special_tokens=False`` to see them."""

    def __init__(self, tool_names: frozenset[str]) -> None:
        self._tools = tool_names
        self._text = ""
        """Received and not given out yet."""
        self._given = 0
        """How many characters have left ``_text`` from its front: with an index, a position in the whole output."""
        self._count = 0
        self._fresh = True
        """Nothing but whitespace given out yet: some formats' calls may only open the output."""
        self._after_call = False
        """The last thing given out is a call: what follows may continue the calls, and whitespace is the format's."""
        self._brackets: _Brackets | None = None
        self._awaiting: str | None = None
        """The marker that closes the call open at the front of the held text: nothing is decided until it comes."""
        self._awaited: list[str] = []
        """Pieces received while a marker is awaited, not joined to the held text yet."""
        self._recent = ""
        """The last characters received while a marker is awaited: it may begin in one piece and end in the next."""

    def feed(self, text: str) -> ParsedDelta:
        """The next piece of generated text, of any size (it may split a marker or a JSON string anywhere). While an
        open call awaits its closing marker, a piece without it is only kept: a call streamed a token at a time
        costs time in proportion to its length, not to its square."""
        if self._awaiting is not None:
            recent = self._recent + text
            self._awaited.append(text)
            if self._awaiting not in recent:
                self._recent = recent[-(len(self._awaiting) - 1) :]
                return ParsedDelta("")
        else:
            self._awaited.append(text)
        return self._step(final=False)

    def finish(self) -> ParsedDelta:
        """End of generation: what was held back is decided now (an open call is content)."""
        return self._step(final=True)

    def _region(self, text: str, final: bool) -> Region | int:
        """The first stretch of call syntax in ``text`` (which follows what was given out) once it is complete; else
        where the undecided tail begins (an open call, or what may begin a marker): the text before it is content.
        With ``final`` the tail is decided as content, unless the format reads an open call at the end."""
        raise NotImplementedError

    def _await(self, marker: str) -> None:
        """Called by ``_region`` as it answers that a call is open at the front of the held text: nothing is decided
        before ``marker`` comes."""
        self._awaiting = marker

    def _step(self, final: bool) -> ParsedDelta:
        self._text += "".join(self._awaited)
        self._awaited, self._awaiting = [], None
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            found = self._region(self._text, final)
            if isinstance(found, int):
                upto = len(self._text) if final else len(self._text[:found].rstrip())
                self._content(self._text[:upto], content)
                self._drop(upto)
                if self._awaiting is not None:  # the held text may end with the marker's first characters
                    self._recent = self._text[len(self._text) - len(self._awaiting) + 1 :]
                return ParsedDelta("".join(content), tuple(calls))
            if found.calls is None:
                self._content(self._text[: found.end], content)
            else:
                self._content(self._text[: found.start].rstrip(), content)
                for name, arguments in found.calls:
                    calls.append(ToolCallDelta(self._count, name, arguments))
                    self._count += 1
                self._fresh, self._after_call = False, True
            self._drop(found.end)

    def _content(self, text: str, out: list[str]) -> None:
        if self._after_call:
            text = text.lstrip()
        if text:
            out.append(text)
            self._after_call = False
            self._fresh = self._fresh and text.isspace()

    def _drop(self, count: int) -> None:
        self._text = self._text[count:]
        self._given += count

    # ---- helpers for the formats ------------------------------------------------------------------------------------

    def _bracketed(
        self, text: str, start: int, after: int, bracket: str, read: Callable[[str], list[Call] | None]
    ) -> Region | int:
        """The call syntax opened at ``start`` (by an opener that ends at ``after``) goes on, past whitespace, with a
        value in ``bracket``: its region once the value closes, its calls as ``read`` finds them; ``start`` while it
        is open; the opener alone, as content, when something else follows it."""
        at = len(text) - len(text[after:].lstrip())
        if at == len(text):
            return start
        if text[at] != bracket:
            return Region(start, after, None)
        end = self._closing(text, at)
        return start if end is None else Region(start, end, read(text[at:end]))

    def _closing(self, text: str, at: int) -> int | None:
        """Where the bracket at ``text[at]`` is closed (the index just past it), or None while it is open. The scan
        goes on from where the last call left it, so a long call fed a token at a time is scanned once."""
        origin = self._given + at
        if self._brackets is None or self._brackets.origin != origin:
            self._brackets = _Brackets(origin)
        end = self._brackets.scan(text, at)
        return None if end is None else at + end

    def _call(self, name: Any, arguments: Any) -> Call | None:
        """A call of one of the request's tools with an object of arguments; None for anything else."""
        if isinstance(name, str) and name in self._tools and isinstance(arguments, dict):
            return name, dumps(arguments)
        return None

    def _object_call(self, value: Any, *keys: str) -> Call | None:
        """The call a JSON object ``{"name": ..., key: {...}}`` makes (``key`` the first of ``keys`` it has)."""
        if not isinstance(value, dict):
            return None
        return self._call(value.get("name"), next((value[key] for key in keys if key in value), None))


def every(calls: Iterable[Call | None]) -> list[Call] | None:
    """All the calls, or None (the stretch is content) when there are none or any one is not a call."""
    found: list[Call] = []
    for call in calls:
        if call is None:
            return None
        found.append(call)
    return found or None


def load(text: str) -> Any:
    """The JSON value of ``text``, or None when it is not JSON (no call is ``null`` either). NaN and Infinity are not
    JSON: arguments holding them could not be written back out."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def dumps(value: Any) -> str:
    """Arguments as compact JSON (non-ASCII kept as is); ValueError or TypeError when a value has no JSON form."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def marker_tail(text: str, markers: tuple[str, ...]) -> int:
    """Where a tail of ``text`` that may be the start of a marker begins (``len(text)`` when none may)."""
    firsts = {marker[0] for marker in markers}
    for start in range(max(0, len(text) - max(map(len, markers)) + 1), len(text)):
        if text[start] in firsts and any(marker.startswith(text[start:]) for marker in markers):
            return start
    return len(text)


class _Brackets:
    """Finds where a bracketed JSON value or Python literal closes: brackets are counted outside strings (quoted with
    ``"`` or ``'``, backslash escapes). A Python triple-quoted string holding a lone quote misleads it; such a call
    stays open, and at the end of generation is content."""

    __slots__ = ("_depth", "_end", "_escaped", "_quote", "_seen", "origin")

    def __init__(self, origin: int) -> None:
        self.origin = origin
        self._seen = 0
        self._depth = 0
        self._quote = ""
        self._escaped = False
        self._end: int | None = None

    def scan(self, text: str, at: int) -> int | None:
        """Where the value opened at ``text[at]`` closes, counted from ``at``; ``text`` has grown since the last
        scan."""
        if self._end is not None:
            return self._end
        for i in range(self._seen, len(text) - at):
            char = text[at + i]
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == self._quote:
                    self._quote = ""
            elif char in "\"'":
                self._quote = char
            elif char in "[{(":
                self._depth += 1
            elif char in "]})":
                self._depth -= 1
                if self._depth == 0:
                    self._end = i + 1
                    return self._end
        self._seen = len(text) - at
        return None
