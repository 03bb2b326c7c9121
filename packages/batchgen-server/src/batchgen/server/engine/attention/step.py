"""The step the attention function serves: which forward is running, what each of its sequences attends to, and the
decodes' rows of the block tables (``DecodeBlocks``), which every decode kernel reads.

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

from ..ops.fast_paths import FastPath
from ..ops.transfer import to_device
from .kv_cache import KVCache
from .layer import LayerAttention
from .selection import Chunk, Decodes, SparseContexts, attend_selected


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
    spans: tuple[tuple[int, int], ...] = ()
    """Runs of positions ``[first, end)`` whose tokens also see each other's later keys (a prefill chunk over a
    Gemma 3 image: ``multimodal/prompt.py``); each lies whole within the chunk and its context."""

    @property
    def end(self) -> int:
        """Context length once this step's tokens are in the cache."""
        return self.start + self.num_tokens


@dataclass(frozen=True, slots=True)
class DecodeBlocks:
    """What a step's decodes see, for one window size. Decode ``i`` sees positions ``first[i]`` to ``last[i]`` (its
    own); column ``j`` of its row in ``tables`` is the block holding positions from ``(first[i] // block_size + j) *
    block_size`` on. A row's columns past the decode's last block are stale: valid block ids, never attended (the
    kernels stop at each decode's last block; the plain versions read them and mask them out)."""

    tables: torch.Tensor
    """``[B, W]`` int64 (``W`` the most blocks any decode sees)."""
    first: torch.Tensor
    """``[B]`` int64: the first visible position (causal: 0; a sliding window's start)."""
    last: torch.Tensor
    """``[B]`` int64: the query's own position, the last visible."""
    block_size: int

    def to(self, device: torch.device) -> DecodeBlocks:
        if self.tables.device == device:
            return self
        tables, first, last = (to_device(tensor, device) for tensor in (self.tables, self.first, self.last))
        return DecodeBlocks(tables, first, last, self.block_size)

    @classmethod
    def build(cls, decodes: list[SeqSlice], window: int | None, block_size: int, tables: np.ndarray) -> DecodeBlocks:
        """The decodes' rows, cut from ``tables`` (``block_tables.py``) with one index on the host: this runs every
        step, and a Python pass over the blocks, or torch's small ops, cost milliseconds at batch 256."""
        bs, count = block_size, len(decodes)
        last = np.fromiter((s.start for s in decodes), np.int64, count)
        rows = np.fromiter((s.table_row for s in decodes), np.int64, count)
        if window is None:
            first = np.zeros_like(last)
            view = tables[rows, : int(last.max()) // bs + 1]
        else:
            first = np.maximum(last - window + 1, 0)
            first_block = first // bs
            columns = first_block[:, None] + np.arange(int((last // bs - first_block).max()) + 1)
            view = tables[rows[:, None], np.minimum(columns, tables.shape[1] - 1)]  # past a row's end: stale
        return cls(torch.from_numpy(view), torch.from_numpy(first), torch.from_numpy(last), bs)

    def rows(self, start: int, stop: int) -> DecodeBlocks:
        """Decodes ``start`` to ``stop``."""
        return DecodeBlocks(self.tables[start:stop], self.first[start:stop], self.last[start:stop], self.block_size)

    def positions(self) -> torch.Tensor:
        """``[B, W * block_size]`` the position each slot of ``tables`` holds."""
        bs, width = self.block_size, self.tables.shape[1]
        start = self.first.div(bs, rounding_mode="floor") * bs
        return start[:, None] + torch.arange(width * bs, device=self.tables.device)

    def visible(self) -> torch.Tensor:
        """``[B, W * block_size]`` which slots of ``tables`` each decode sees."""
        positions = self.positions()
        return (positions >= self.first[:, None]) & (positions <= self.last[:, None])


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


class StateLayers(Protocol):
    """The state layers' part of a forward (``state/mixers.py``), which the ``batchgen::state_mixer`` operator runs."""

    layers_run: int

    def run(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def encoded(self) -> list[int]:
        """The step's layout as int64s, for a split model's other ranks."""
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
    states: StateLayers | None = None
    """Where the model has state layers (recurrent mixers, short convolutions): what they run in this step."""
    spans_on_sliding_only: bool = False
    """The sequences' ``spans`` hold on sliding-window layers only (Gemma 4; Gemma 3's on every layer)."""
    layers_attended: int = 0
    """Layers run so far in this forward: the next one's index in the cache (layers run in the order the probe
    found them; the runner checks that every one ran)."""
    _memo: dict[Any, Any] = field(default_factory=dict)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: LayerAttention,
        selected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        index = self.layers_attended
        self.layers_attended += 1
        self.cache.write(index, self.slot_mapping, key[0], value[0])
        if selected is not None:  # a DSA layer: each query over its own selection, whatever the backend
            contexts = self.sparse_contexts()
            return attend_selected(self.cache.k[index], self.cache.v[index], query, layer, selected, contexts)
        return self.backend.attend(self, index, query, key, value, layer)

    def sparse_contexts(self) -> SparseContexts:
        """What the step's DSA layers read (``selection.py``), built once a step."""
        return self.memo("sparse", self._build_sparse_contexts)  # type: ignore[no-any-return]

    def _build_sparse_contexts(self) -> SparseContexts:
        bs, tables, device = self.cache.block_size, self.block_tables, self.cache.k[0].device
        chunks = []
        for seq in self.seqs:
            if seq.num_tokens > 1:
                slots = _slots(tables[seq.table_row : seq.table_row + 1], seq.end, bs)
                positions = torch.arange(seq.start, seq.end, device=device)
                chunks.append(Chunk(slice(seq.row, seq.row + seq.num_tokens), positions, to_device(slots, device)))
        decodes = [s for s in self.seqs if s.num_tokens == 1]
        if not decodes:
            return SparseContexts(chunks, None)
        count = len(decodes)
        rows = np.fromiter((s.row for s in decodes), np.int64, count)
        starts = np.fromiter((s.start for s in decodes), np.int64, count)
        table_rows = tables[np.fromiter((s.table_row for s in decodes), np.int64, count)]
        slots = _slots(table_rows, int(starts.max()) + 1, bs)  # past a row's end: stale, never visible
        group = Decodes(
            to_device(torch.from_numpy(rows), device),
            to_device(torch.from_numpy(starts), device),
            to_device(slots, device),
        )
        return SparseContexts(chunks, group)

    def blocks(self, seq: SeqSlice, first: int = 0) -> np.ndarray:
        """``seq``'s blocks from its ``first`` up to the last its tokens fill once the step's are in (a copy)."""
        return self.block_tables[seq.table_row, first : -(-seq.end // self.cache.block_size)].copy()

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """What a backend derives once per step (and per window) and every layer reuses."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]


def _slots(tables: np.ndarray, width: int, block_size: int) -> torch.Tensor:
    """``[rows, width]`` the cache slots of positions ``0..width-1`` through each row of ``tables``."""
    blocks = tables[:, : -(-width // block_size)]
    slots = blocks[:, :, None] * block_size + np.arange(block_size)
    return torch.from_numpy(slots.reshape(len(tables), -1)[:, :width])


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
