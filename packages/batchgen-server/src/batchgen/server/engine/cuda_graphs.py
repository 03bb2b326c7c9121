"""CUDA graphs of decode steps: a small model's decode step is mostly kernel launches, which a graph replays at once.

A graph is captured on first use for each (batch, pairs) bucket: the batch is rounded up to a bucket size, the
number of (sequence, block) pairs of the decode kernel to a power of two. Everything the step reads lives in the
graph's own static tensors, refilled before each replay with one non-blocking copy each: token ids, positions, cache
slots, and each window's decode pairs (``attention/decode.py``). Padding rows write their keys and values to a
scratch block no sequence owns and attend to that block alone; padding pairs see nothing. The logits of every row
come out of the graph; the sampler takes the real rows.

Only steps of decodes alone use a graph (prefill chunks vary too much in shape); a capture or replay that fails
turns graphs off for good, with the reason in the log, and the step runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .attention import PagedStep, active
from .attention.decode import DecodeKernel, DecodePairs
from .attention.layer import LayerAttention
from .inputs import PackedInputs
from .kv_cache import KVCache

logger = logging.getLogger(__name__)

MIN_PAIRS = 16


def batch_buckets(max_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to 128, of 32 up to 256, of 64 beyond, and ``max_seqs`` itself."""
    sizes = [1, 2, 4, 8, *range(16, 129, 16), *range(160, 257, 32), *range(320, max_seqs + 64, 64)]
    return sorted({size for size in sizes if size < max_seqs} | {max_seqs})


class Graph(Protocol):
    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor: ...
    def replay(self) -> None: ...


class CudaGraph:
    """``torch.cuda.CUDAGraph``, warmed up on a side stream first (compilation and autotuning happen there)."""

    def __init__(self, pool: tuple[int, int]) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    @classmethod
    def maker(cls) -> Callable[[], Graph]:
        """New graphs that share one memory pool (they never run at the same time)."""
        pool = torch.cuda.graph_pool_handle()
        return lambda: cls(pool)

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            return forward()

    def replay(self) -> None:
        self.graph.replay()


@dataclass(slots=True)
class _Bucket:
    graph: Graph
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    pairs: dict[int | None, DecodePairs]
    logits: torch.Tensor | None = None


class _StaticDecodes:
    """The graph's attention backend: the decode kernel over the bucket's static pairs."""

    def __init__(self, kernel: DecodeKernel, pairs: dict[int | None, DecodePairs]) -> None:
        self.kernel = kernel
        self.pairs = pairs

    def attend(
        self,
        step: PagedStep,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: LayerAttention,
    ) -> torch.Tensor:
        q = query[0].transpose(0, 1)
        pairs = self.pairs[layer.window]
        return self.kernel(q, step.cache.k[layer_index], step.cache.v[layer_index], pairs, layer)


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        cache: KVCache,
        scratch_block: int,
        windows: set[int | None],
        max_seqs: int,
        make_graph: Callable[[], Graph],
    ) -> None:
        self.model = model
        self.cache = cache
        self.scratch_block = scratch_block
        self.windows = windows
        self.buckets = batch_buckets(max_seqs)
        self.make_graph = make_graph
        self.kernel = DecodeKernel()
        self._graphs: dict[tuple[int, int], _Bucket] = {}
        self.device = cache.k[0].device

    @property
    def captured(self) -> int:
        """Graphs captured so far."""
        return len(self._graphs)

    def run(self, packed: PackedInputs) -> torch.Tensor:
        """The logits ``[decodes, vocab]`` of a step of decodes alone."""
        batch = len(packed.seqs)
        bucket = next(size for size in self.buckets if size >= batch)
        bs = self.cache.block_size
        pairs = {w: DecodePairs.build(packed.seqs, w, bs, packed.block_tables) for w in self.windows}
        # Each padding row gets one pair: the scratch block's first slot.
        needed = max(p.seq.shape[0] for p in pairs.values()) + bucket - batch
        size = max(MIN_PAIRS, 1 << (needed - 1).bit_length())
        graph = self._graphs.get((bucket, size))
        if graph is None:
            graph = self._capture(bucket, size)
        for static, value in zip(
            (graph.input_ids, graph.positions, graph.slots),
            (packed.input_ids, packed.positions, packed.slots),
            strict=True,
        ):
            static[:batch].copy_(value, non_blocking=True)
        graph.slots[batch:].fill_(self.scratch_block * bs)  # padding rows: stale slots would overwrite a sequence
        for window, static_pairs in graph.pairs.items():
            self._fill(static_pairs, pairs[window], batch, bucket)
        graph.graph.replay()
        assert graph.logits is not None
        return graph.logits[:batch]

    def _fill(self, static: DecodePairs, pairs: DecodePairs, batch: int, bucket: int) -> None:
        """Real pairs first, then one pair per padding row on the scratch block, then pairs that see nothing."""
        count, size = pairs.seq.shape[0], static.seq.shape[0]
        padding = bucket - batch
        seq = torch.zeros(size, dtype=torch.long)
        seq[:count] = pairs.seq
        seq[count : count + padding] = torch.arange(batch, bucket)
        block = torch.full((size,), self.scratch_block, dtype=torch.long)
        block[:count] = pairs.block
        visible = torch.zeros(size, static.visible.shape[1], dtype=torch.bool)
        visible[:count] = pairs.visible
        visible[count : count + padding, 0] = True
        offsets = torch.cat([pairs.offsets, count + torch.arange(1, padding + 1)])
        for target, source in zip(
            (static.seq, static.block, static.visible, static.offsets), (seq, block, visible, offsets), strict=True
        ):
            target.copy_(source.pin_memory() if self.device.type == "cuda" else source, non_blocking=True)

    def _capture(self, bucket: int, size: int) -> _Bucket:
        """A graph for ``bucket`` decodes over ``size`` pairs, captured on an all-padding step."""
        bs, device = self.cache.block_size, self.device
        scratch_slot = self.scratch_block * bs
        pairs = {
            window: DecodePairs(
                torch.zeros(size, dtype=torch.long, device=device),
                torch.full((size,), self.scratch_block, dtype=torch.long, device=device),
                torch.zeros(size, bs, dtype=torch.bool, device=device),
                torch.arange(bucket + 1, device=device),
            )
            for window in self.windows
        }
        for static in pairs.values():
            static.seq[:bucket] = torch.arange(bucket, device=device)
            static.visible[:bucket, 0] = True
        graph = _Bucket(
            self.make_graph(),
            torch.zeros(bucket, dtype=torch.long, device=device),
            torch.zeros(bucket, dtype=torch.long, device=device),
            torch.full((bucket,), scratch_slot, dtype=torch.long, device=device),
            pairs,
        )
        step = PagedStep(
            self.cache, _StaticDecodes(self.kernel, pairs), [], np.empty((0, 0), np.int64), graph.slots, device
        )

        def forward() -> torch.Tensor:
            step.layers_attended = 0
            with active(step):
                out = self.model(
                    input_ids=graph.input_ids.unsqueeze(0),
                    position_ids=graph.positions.unsqueeze(0),
                    use_cache=False,
                    logits_to_keep=0,
                )
            return out.logits[0]

        graph.logits = graph.graph.capture(forward)
        self._graphs[(bucket, size)] = graph
        logger.info("captured a CUDA graph for %d decodes over %d block pairs", bucket, size)
        return graph
