"""Incremental detokenization and stop strings that may span token boundaries."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time and finds stop strings as soon as they appear.

    A token that ends inside a multi-byte character decodes to U+FFFD; its text is held back until the character is
    complete (the usual prefix/read offset scheme).
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_id: int, find_stop: bool = True) -> bool:
        """Append a token; return ``True`` when the text now contains a stop string (the text is cut before it).
        ``find_stop=False`` appends without looking (before ``min_tokens``)."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = decode(self.token_ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        if not find_stop:
            return False
        hits = [i for i in (self.text.find(stop, start) for stop in self.stop) if i != -1]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def finish(self) -> str:
        """The final text, including any held-back tail (call only when no stop string was found)."""
        if self._read_offset < len(self.token_ids):
            prefix = self.tokenizer.decode(
                self.token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
            )
            full = self.tokenizer.decode(self.token_ids[self._prefix_offset :], skip_special_tokens=True)
            self.text += full[len(prefix) :]
            self._read_offset = len(self.token_ids)
        return self.text
