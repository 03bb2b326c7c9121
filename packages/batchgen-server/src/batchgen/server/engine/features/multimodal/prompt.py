"""A prompt's images as an engine request carries them: each image's content key, the prompt positions its feature
rows take (its placeholder tokens, in order) and the pixels its family's vision tower reads; for an M-RoPE model,
the prompt's 3-D positions once the engine has computed them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(eq=False, slots=True)
class ImageInput:
    key: bytes
    """The sha256 of the image's bytes: the encoder cache's key, and part of its KV blocks' prefix-cache keys."""
    placeholders: np.ndarray
    """The prompt positions (int64, ascending) its encoder output's rows fill, row ``i`` at ``placeholders[i]``."""
    pixels: dict[str, Any]
    """What the family's vision tower reads for this image alone (tensors: ``pixel_values``, its grid...)."""

    @property
    def first(self) -> int:
        return int(self.placeholders[0])

    @property
    def last(self) -> int:
        return int(self.placeholders[-1])


@dataclass(eq=False, slots=True)
class MultimodalPrompt:
    images: tuple[ImageInput, ...]
    extras: dict[str, Any] = field(default_factory=dict)
    """What the family computes the prompt's positions from (``mm_token_type_ids``...)."""
    mrope: np.ndarray | None = None
    """``[3, prompt tokens]`` positions of an M-RoPE model (Qwen2/2.5/3-VL), set by the engine on first use."""
    mrope_delta: int = 0
    """A generated token at index ``i`` is at position ``i + mrope_delta`` on all three axes."""
    spans: tuple[tuple[int, int], ...] = ()
    """Families whose image tokens attend to each other both ways (Gemma 3): each run of placeholders ``[first,
    end)``. A prefill chunk never ends inside one (``chunk_tokens``), so the run's queries see all its keys."""

    def chunk_tokens(self, start: int, num_tokens: int) -> int:
        """A chunk from ``start`` of up to ``num_tokens`` tokens, cut before a run it would end inside, or run on to
        the run's end where it starts inside it (over the step's budget by at most one image)."""
        end = start + num_tokens
        for first, last in self.spans:
            if first < end < last:
                return first - start if first > start else last - start
        return num_tokens

    def spans_in(self, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """The runs with a query in ``[start, end)``."""
        return tuple(span for span in self.spans if span[0] < end and span[1] > start)

    def block_keys(self, start: int, end: int) -> tuple[bytes, ...]:
        """The keys of the images with a placeholder in prompt positions ``[start, end)``: hashed into that KV
        block's prefix-cache key, so two pictures behind the same placeholder tokens never share KV."""
        return tuple(image.key for image in self.images if image.first < end and image.last >= start)
