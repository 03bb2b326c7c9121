"""Pythonic tool calls (Llama 3.2 and 4, ToolACE): ``[get_weather(city="Oslo", days=3), other(x=[1, 2])]``."""

from __future__ import annotations

import ast
import re

from .calls import Call, Region, ToolCallParser, every, marker_tail

_PYTHON_END = re.compile(r"\s*<\|python_end\|>")


class PythonicToolParser(ToolCallParser):
    """A Python list of calls by keyword, each value a literal (strings, numbers, booleans, None, lists, dicts), given
    out as a JSON object. The list opens the output, or follows Llama 4's ``<|python_start|>`` (its
    ``<|python_end|>`` after the list is dropped). It is all calls or, when any item is not one, all content. As in
    vLLM, an output that opens with ``[`` is held until that bracket closes; text after the list is content here
    (vLLM makes the whole output content then)."""

    markers = ("<|python_start|>", "<|python_end|>")

    def _region(self, text: str, final: bool) -> Region | int:
        if self._after_call and (python_end := _PYTHON_END.match(text)):
            return Region(0, python_end.end(), [])
        head = len(text) - len(text.lstrip())
        if self._fresh and text[head : head + 1] == "[":
            return self._bracketed(text, head, head, "[", self._calls)
        tag = text.find("<|python_start|>")
        if tag < 0:
            return marker_tail(text, self.markers)
        return self._bracketed(text, tag, tag + len("<|python_start|>"), "[", self._calls)

    def _calls(self, source: str) -> list[Call] | None:
        try:
            tree = ast.parse(source, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):  # ValueError: a NUL character
            return None
        return every(map(self._python_call, tree.elts)) if isinstance(tree, ast.List) else None

    def _python_call(self, node: ast.expr) -> Call | None:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        names = [keyword.arg for keyword in node.keywords]
        if None in names or len(set(names)) < len(names):  # **kwargs; a repeated keyword (Python refuses it)
            return None
        try:
            return self._call(node.func.id, {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords})
        except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal; a value with no JSON form
            return None
