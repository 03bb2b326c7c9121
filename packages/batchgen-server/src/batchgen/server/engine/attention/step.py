"""The step the attention function serves: which forward is running, and what each of its sequences attends to.

The model runner makes the step current for the duration of one forward (a thread-local, so that models whose
layers do not pass extra keyword arguments through to attention work too, and so that a compiled layer sees none
of it); the attention operator finds it there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ..fast_paths import FastPath
from ..kv_cache import KVCache
from .layer import LayerAttention


@dataclass(slots=True)
class SeqSlice:
    """One scheduled sequence's new tokens in the packed row. Not frozen: a frozen dataclass costs four times as
    much to make (0.9 against 0.25 us), and one is made for every sequence of every step."""

    row: int
    """First packed row."""
    num_tokens: int
    start: int
    """Position of the first new token: the sequence's tokens before it are already in the cache."""
    table_row: int
    """The sequence's row in the step's ``block_tables``."""

    @property
    def end(self) -> int:
        """Context length once this step's tokens are in the cache."""
        return self.start + self.num_tokens


class AttentionBackend(Protocol):
    def attend(
        self,
        step: PagedStep,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: LayerAttention,
    ) -> torch.Tensor:
        """Attend the step's packed queries ``[1, H, T, D]`` over each sequence's context in the cache, where this
        step's keys and values (also given, ``[1, KVH, T, D]``) are already written; return ``[T, H, Dv]``."""
        ...

    @property
    def paths(self) -> list[FastPath]:
        """Its fast paths (``fast_paths.py``)."""
        ...


@dataclass(eq=False)
class PagedStep:
    """One packed forward over the paged KV cache."""

    cache: KVCache
    backend: AttentionBackend
    seqs: list[SeqSlice]
    block_tables: np.ndarray
    """Each sequence's blocks from column 0 of its ``table_row`` (``block_tables.py``): read while the step's
    forward is built, before anything changes them."""
    slot_mapping: torch.Tensor
    """Cache slot of each packed token."""
    device: torch.device
    layers_attended: int = 0
    """Layers run so far in this forward: the next one's index in the cache (layers run in the order the probe
    found them; the runner checks that every one ran)."""
    _memo: dict[Any, Any] = field(default_factory=dict)

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: LayerAttention
    ) -> torch.Tensor:
        index = self.layers_attended
        self.layers_attended += 1
        self.cache.write(index, self.slot_mapping, key[0], value[0])
        return self.backend.attend(self, index, query, key, value, layer)

    def blocks(self, seq: SeqSlice, first: int = 0) -> np.ndarray:
        """``seq``'s blocks from its ``first`` up to the last its tokens fill once the step's are in (a copy)."""
        return self.block_tables[seq.table_row, first : -(-seq.end // self.cache.block_size)].copy()

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """What a backend derives once per step (and per window) and every layer reuses."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]


_local = threading.local()


@contextmanager
def active(step: object) -> Iterator[None]:
    """Make ``step`` (a ``PagedStep``, or the probe) what the attention functions of this thread serve."""
    previous = getattr(_local, "step", None)
    _local.step = step
    try:
        yield
    finally:
        _local.step = previous


def current() -> object:
    return getattr(_local, "step", None)
