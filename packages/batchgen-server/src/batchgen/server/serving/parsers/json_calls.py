"""The formats whose calls are JSON: Hermes (Qwen), Llama 3 JSON, Mistral, Kimi K2. Their arguments are objects,
given out re-serialised compactly."""

from __future__ import annotations

import re

from .calls import Call, Region, ToolCallParser, every, load, marker_tail


class HermesToolParser(ToolCallParser):
    """Qwen 2.5 and 3, Hermes 2 Pro and 3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` per call,
    as their chat templates write them. A block still open when generation ends is read to the end of the text, as
    vLLM's regex reads it."""

    markers = ("<tool_call>", "</tool_call>")

    def _region(self, text: str, final: bool) -> Region | int:
        start = text.find("<tool_call>")
        if start < 0:
            return marker_tail(text, self.markers)
        body = start + len("<tool_call>")
        close = text.find("</tool_call>", body)
        if close >= 0:
            return Region(start, close + len("</tool_call>"), self._calls(text[body:close]))
        if final:
            return Region(start, len(text), self._calls(text[body:]))
        self._await("</tool_call>")
        return start

    def _calls(self, body: str) -> list[Call] | None:
        return every([self._object_call(load(body), "arguments")])


class Llama3JsonToolParser(ToolCallParser):
    """Llama 3.1-3.3 (and 4) JSON calls: ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), several joined
    by ``;``, opening the output or after ``<|python_tag|>``. vLLM's whole-text parse also takes an object from the
    middle of the text (and drops the text around it); here, as in vLLM's streaming, an output that opens with
    anything else is content."""

    markers = ("<|python_tag|>",)

    def _region(self, text: str, final: bool) -> Region | int:
        head = len(text) - len(text.lstrip())
        opener = text[head : head + 1]
        if self._fresh and opener == "{":
            return self._bracketed(text, head, head, "{", self._calls)
        if self._after_call and opener == ";":
            return self._bracketed(text, head, head + 1, "{", self._calls)
        tag = text.find("<|python_tag|>")
        if tag < 0:
            return marker_tail(text, self.markers)
        return self._bracketed(text, tag, tag + len("<|python_tag|>"), "{", self._calls)

    def _calls(self, source: str) -> list[Call] | None:
        return every([self._object_call(load(source), "parameters", "arguments")])


_MISTRAL_NAME = re.compile(r"([\w.-]+)(?:\[CALL_ID\][\w-]*)?(?:\[ARGS\])?")
_MISTRAL_NAME_CHARS = re.compile(r"[\w.\-\[\]]*")


class MistralToolParser(ToolCallParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}`` (tokenizers before v11:
    Mistral 7B v0.3, Nemo, Small 3.1), or from v11 (Small 3.2, Magistral, Devstral) ``[TOOL_CALLS]name[ARGS]{...}``
    per call (``[CALL_ID]id`` may come before ``[ARGS]``; vLLM, decoding without special tokens, sees
    ``[TOOL_CALLS]name{...}``, taken too). An array is all calls or, when any item is not one, all content."""

    markers = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")

    def _region(self, text: str, final: bool) -> Region | int:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return marker_tail(text, self.markers)
        after = start + len("[TOOL_CALLS]")
        if not _MISTRAL_NAME.match(text, after):  # an array (or nothing yet)
            return self._bracketed(text, start, after, "[", self._array)
        brace = text.find("{", after)
        if brace < 0:
            return start if _MISTRAL_NAME_CHARS.fullmatch(text, after) else Region(start, after, None)
        name = _MISTRAL_NAME.fullmatch(text, after, brace)
        if name is None:
            return Region(start, after, None)
        return self._bracketed(text, start, brace, "{", lambda source: every([self._call(name[1], load(source))]))

    def _array(self, source: str) -> list[Call] | None:
        items = load(source)
        return every(self._object_call(item, "arguments") for item in items) if isinstance(items, list) else None


_KIMI_OPENERS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>", "<|tool_call_begin|>")
_KIMI_CALL = re.compile(
    r"(?:<\|tool_calls?_section_begin\|>\s*)?<\|tool_call_begin\|>\s*(?:functions\.)?(?P<name>[^\s<]+):\d+\s*"
    r"<\|tool_call_argument_begin\|>(?P<arguments>.*)<\|tool_call_end\|>",
    re.DOTALL,
)
_KIMI_SECTION_END = re.compile(r"\s*<\|tool_calls?_section_end\|>")


class KimiK2ToolParser(ToolCallParser):
    """Kimi K2: ``<|tool_calls_section_begin|>``, per call ``<|tool_call_begin|>functions.NAME:INDEX
    <|tool_call_argument_begin|>{...}<|tool_call_end|>``, then ``<|tool_calls_section_end|>`` (the singular
    ``tool_call_section`` spellings too, as vLLM takes them). vLLM passes the arguments' text through unread; here
    arguments that are not a JSON object leave the call in the content, as in the other formats."""

    markers = (
        *_KIMI_OPENERS,
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_section_end|>",
    )

    def _region(self, text: str, final: bool) -> Region | int:
        if self._after_call and (section_end := _KIMI_SECTION_END.match(text)):
            return Region(0, section_end.end(), [])
        starts = [at for at in map(text.find, _KIMI_OPENERS) if at >= 0]
        if not starts:
            return marker_tail(text, self.markers)
        start = min(starts)
        close = text.find("<|tool_call_end|>", start)
        if close < 0:
            self._await("<|tool_call_end|>")
            return start
        end = close + len("<|tool_call_end|>")
        call = _KIMI_CALL.fullmatch(text, start, end)
        return Region(start, end, None if call is None else every([self._call(call["name"], load(call["arguments"]))]))
