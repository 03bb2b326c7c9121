"""Engine logprobs in OpenAI's shapes: a chat choice's ``content`` entries, a completion's parallel lists (their text
offsets continuing where a streamed chunk's tokens start), and vLLM's ``prompt_logprobs``. Each token's text is
decoded once: the same tokens come back in answer after answer."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from batchgen.schemas import (
    ChoiceLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)

from ..engine.request import TokenLogprob as EngineTokenLogprob


class LogprobFormatter:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.token_text = lru_cache(maxsize=65536)(self._decode)
        """A token's text, as its logprob entries show it."""

    def _decode(self, token_id: int) -> str:
        return str(self._tokenizer.decode([token_id]))

    def chat(self, logprobs: list[EngineTokenLogprob] | None) -> ChoiceLogprobs | None:
        if logprobs is None:
            return None
        content = []
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            top = [TopLogprob(token=(t := self.token_text(i)), bytes=list(t.encode()), logprob=v) for i, v in lp.top]
            content.append(TokenLogprob(token=text, bytes=list(text.encode()), logprob=lp.logprob, top_logprobs=top))
        return ChoiceLogprobs(content=content)

    def completion(
        self,
        logprobs: Sequence[EngineTokenLogprob | None] | None,
        offset: int = 0,
        token_ids: list[int] | None = None,
    ) -> CompletionLogprobs | None:
        """``text_offset`` counts from ``offset`` (where a streamed chunk's tokens start in the choice's text). An
        entry is ``None`` only for an echoed prompt's first token: ``token_ids`` then name every entry's token."""
        if logprobs is None:
            return None
        if token_ids is None:
            token_ids = [lp.token_id for lp in logprobs if lp is not None]
        tokens = [self.token_text(token_id) for token_id in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[None if lp is None else lp.logprob for lp in logprobs],
            top_logprobs=[None if lp is None else self._top_by_text(lp.top) for lp in logprobs],
            text_offset=offsets,
        )

    def prompt(self, logprobs: Sequence[EngineTokenLogprob | None] | None, top: int) -> PromptLogprobs:
        """vLLM's ``prompt_logprobs``: the prompt token's own entry, then the ``top`` likeliest (ranks 1 to ``top``)."""
        wire: PromptLogprobs = []
        for lp in logprobs or []:
            if lp is None:
                wire.append(None)
                continue
            entry = {
                str(lp.token_id): PromptLogprob(
                    logprob=lp.logprob, rank=lp.rank or 0, decoded_token=self.token_text(lp.token_id)
                )
            }
            for rank, (token_id, value) in enumerate(lp.top[:top], start=1):
                entry.setdefault(
                    str(token_id), PromptLogprob(logprob=value, rank=rank, decoded_token=self.token_text(token_id))
                )
            wire.append(entry)
        return wire

    def _top_by_text(self, top: tuple[tuple[int, float], ...]) -> dict[str, float]:
        """Top logprobs keyed by token text, most likely first; tokens that decode alike (the bytes of a split
        character) keep the likeliest's value, so the largest value is always the top token's."""
        by_text: dict[str, float] = {}
        for token_id, value in top:
            by_text.setdefault(self.token_text(token_id), value)
        return by_text
