"""CUDA graphs of decode steps: a small model's decode step is mostly kernel launches, which a graph replays at once.

A graph is captured on first use for each (batch, width) bucket: the batch is rounded up to a bucket size, the most
blocks a decode sees to a power of two. Everything the step reads lives in the graph's own static tensors, refilled
before each replay with one non-blocking copy each: token ids, positions, cache slots, and each window's decode
block tables and bounds (``attention/decode.py``). Padding rows write their keys and values to a scratch block no
sequence owns and attend to its first slot alone. The logits of every row come out of the graph; the sampler takes
the real rows.

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

from ..attention import DecodeBlocks, PagedStep, active
from ..attention.decode import DecodeKernel
from ..attention.kv_cache import KVCache
from ..attention.layer import LayerAttention
from ..ops.fast_paths import FastPath
from .inputs import PackedInputs

logger = logging.getLogger(__name__)

MIN_WIDTH = 16
"""Blocks a decode sees, at least, in a graph (256 tokens of 16-token blocks)."""


def batch_buckets(max_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to 128, of 32 up to 256, of 64 beyond, and ``max_seqs`` itself."""
    sizes = [1, 2, 4, 8, *range(16, 129, 16), *range(160, 257, 32), *range(320, max_seqs + 64, 64)]
    return sorted({size for size in sizes if size < max_seqs} | {max_seqs})


class Graph(Protocol):
    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor: ...
    def replay(self) -> None: ...


class CudaGraph:
    """``torch.cuda.CUDAGraph``, warmed up on a side stream first (compilation and autotuning happen there)."""

    def __init__(self, pool: torch.cuda._POOL_HANDLE) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    @classmethod
    def maker(cls) -> Callable[[], Graph]:
        """New graphs that share one memory pool (they never run at the same time)."""
        pool = torch.cuda.graph_pool_handle()
        return lambda: cls(pool)

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
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
    blocks: dict[int | None, DecodeBlocks]
    logits: torch.Tensor | None = None


class _StaticDecodes:
    """The graph's attention backend: the decode kernel over the bucket's static block tables."""

    def __init__(self, kernel: DecodeKernel, blocks: dict[int | None, DecodeBlocks]) -> None:
        self.kernel = kernel
        self.blocks = blocks

    @property
    def paths(self) -> list[FastPath]:
        return [self.kernel.path]

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
        blocks = self.blocks[layer.window]
        return self.kernel(q, step.cache.k[layer_index], step.cache.v[layer_index], blocks, layer)


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
        blocks = {w: DecodeBlocks.build(packed.seqs, w, bs, packed.block_tables) for w in self.windows}
        needed = max(b.tables.shape[1] for b in blocks.values())
        width = max(MIN_WIDTH, 1 << (needed - 1).bit_length())
        graph = self._graphs.get((bucket, width))
        if graph is None:
            graph = self._capture(bucket, width)
        for static, value in zip(
            (graph.input_ids, graph.positions, graph.slots),
            (packed.input_ids, packed.positions, packed.slots),
            strict=True,
        ):
            static[:batch].copy_(value, non_blocking=True)
        graph.slots[batch:].fill_(self.scratch_block * bs)  # padding rows: stale slots would overwrite a sequence
        for window, static_blocks in graph.blocks.items():
            self._fill(static_blocks, blocks[window], batch)
        graph.graph.replay()
        assert graph.logits is not None
        return graph.logits[:batch]

    def _fill(self, static: DecodeBlocks, blocks: DecodeBlocks, batch: int) -> None:
        """The real rows, then padding rows that see the scratch block's first slot alone."""
        bucket, width = static.tables.shape
        tables = torch.full((bucket, width), self.scratch_block, dtype=torch.long)
        tables[:batch, : blocks.tables.shape[1]] = blocks.tables
        first, last = torch.zeros(bucket, dtype=torch.long), torch.zeros(bucket, dtype=torch.long)
        first[:batch], last[:batch] = blocks.first, blocks.last
        for target, source in zip((static.tables, static.first, static.last), (tables, first, last), strict=True):
            target.copy_(source.pin_memory() if self.device.type == "cuda" else source, non_blocking=True)

    def _capture(self, bucket: int, width: int) -> _Bucket:
        """A graph for ``bucket`` decodes that see up to ``width`` blocks each, captured on an all-padding step."""
        bs, device = self.cache.block_size, self.device
        scratch_slot = self.scratch_block * bs
        blocks = {
            window: DecodeBlocks(
                torch.full((bucket, width), self.scratch_block, dtype=torch.long, device=device),
                torch.zeros(bucket, dtype=torch.long, device=device),
                torch.zeros(bucket, dtype=torch.long, device=device),
                bs,
            )
            for window in self.windows
        }
        graph = _Bucket(
            self.make_graph(),
            torch.zeros(bucket, dtype=torch.long, device=device),
            torch.zeros(bucket, dtype=torch.long, device=device),
            torch.full((bucket,), scratch_slot, dtype=torch.long, device=device),
            blocks,
        )
        step = PagedStep(
            self.cache, _StaticDecodes(self.kernel, blocks), [], np.empty((0, 0), np.int64), graph.slots, device
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
            logits: torch.Tensor = out.logits[0]
            return logits

        graph.logits = graph.graph.capture(forward)
        self._graphs[(bucket, width)] = graph
        logger.info("captured a CUDA graph for %d decodes of up to %d blocks", bucket, width)
        return graph
