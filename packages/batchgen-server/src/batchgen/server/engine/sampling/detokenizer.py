"""Incremental detokenization and stop strings that may span token boundaries."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def backend_of(tokenizer: Any) -> Tokenizer | None:
    """The ``tokenizers`` tokenizer whose ``decode`` is all of ``tokenizer.decode`` (a fast tokenizer that does not
    clean up spaces after it), else ``None`` (a slow tokenizer; one whose ``decode`` does more)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time and finds stop strings as soon as they appear.

    The prefix/read offset scheme: the text of the tokens from the read offset on is the text of the window from the
    prefix offset, less the text of the window up to the read offset; a token that ends inside a multi-byte character
    decodes to U+FFFD, and its text is held back until the character is complete. A fast tokenizer's windows are
    decoded in Rust by ``tokenizers``' ``DecodeStream`` (as vLLM v1 does), one call a token; the windows through
    ``tokenizer.decode`` serve slow tokenizers, and a sequence the stream refuses from there on: it raises where a
    window's text does not start with its prefix's (with byte fallback, bytes that decoded to characters alone
    become U+FFFD once the bytes after them make their sequence invalid). Both keep the same offsets, so the text is
    the same whichever decodes.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._backend = backend_of(tokenizer)
        self._stream = None if self._backend is None else DecodeStream(skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int, find_stops: bool = True) -> bool:
        """Append a token; return ``True`` when the text now contains a stop string (the text is cut before it).
        With ``find_stops`` false (before ``min_tokens``), stop strings are not looked for in the new text."""
        self.token_ids.append(token_id)
        delta = self._delta()
        if delta is None:
            return False
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        hits = [i for i in (self.text.find(stop, start) for stop in self.stop) if i != -1] if find_stops else []
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def finish(self) -> str:
        """The final text, including any held-back tail (call only when no stop string was found)."""
        if self._read_offset < len(self.token_ids):
            prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
            full = self._decode(self.token_ids[self._prefix_offset :])
            self.text += full[len(prefix) :]
            self._read_offset = len(self.token_ids)
        return self.text

    def _delta(self) -> str | None:
        """The text the last token completes, if any (never empty)."""
        if self._stream is not None:
            assert self._backend is not None  # a stream only over a backend
            try:
                delta: str | None = self._stream.step(self._backend, self.token_ids[-1])
                return delta
            except Exception:  # tokenizers raises a plain Exception: "Invalid prefix encountered"
                self._stream = None
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        return full[len(prefix) :]

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend is not None:  # what ``tokenizer.decode`` calls, without its Python around it
            return self._backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens))
