"""A request's prompts as token-id lists: a text through the tokenizer, refused first when it cannot fit the
context (tokenizing takes memory and time in proportion to the text); token ids as given."""

from __future__ import annotations

from typing import Any

from .errors import RequestRejected


class PromptTokenizer:
    def __init__(self, tokenizer: Any, max_context_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_context_length = max_context_length
        self.max_prompt_chars = max_context_length * max(map(len, tokenizer.get_vocab()), default=1)
        """A text prompt longer than this cannot fit the context: every token covers at most as many characters as
        the longest entry of the vocabulary (unless the tokenizer's normalizer drops characters)."""

    def prompts(self, prompt: str | list[Any], param: str, add_special_tokens: bool) -> list[list[int]]:
        """Text, a list of texts, a list of token ids, or a list of token-id lists -> token-id lists."""
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            items = [prompt]
        else:
            items = prompt
        if not items:
            raise RequestRejected("invalid_value", f"{param} must not be empty", param)
        prompts = []
        for item in items:
            if isinstance(item, str):
                ids = self.tokenize(item, param, add_special_tokens)
            elif isinstance(item, list) and all(isinstance(t, int) for t in item):
                ids = item
            else:
                raise RequestRejected(
                    "invalid_type", f"{param} must be text, texts, token ids or token-id lists", param
                )
            if not ids:
                raise RequestRejected("invalid_value", f"{param} must not be empty", param)
            prompts.append(ids)
        return prompts

    def tokenize(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        if len(text) > self.max_prompt_chars:
            raise RequestRejected(
                "context_length_exceeded",
                f"'{param}' has {len(text)} characters: more than the model's context of {self.max_context_length} "
                f"tokens can hold (at most {self.max_prompt_chars} characters with this tokenizer).",
                param,
            )
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
