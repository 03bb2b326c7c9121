"""The gather backend: the CPU path (any device runs it).

Decodes attend in one batched call: on the fast path through ``decode.py``'s kernel, which reads the cache in place;
eagerly, each decode's context is copied block by block into buffers reused across layers and steps (padded to the
longest, masked) and attended with SDPA. Each prefill chunk attends in its own call, against its own new keys alone
when it starts the sequence, else against its gathered context; on the fast path on CUDA, all of a step's chunks
attend in one flash-attention call instead (``varlen.py``), where the layer allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.fast_paths import FastPath
from ..ops.transfer import indices, to_device
from .decode import DecodeKernel, first_visible
from .kernels import attend, both_ways, causal_mask
from .layer import LayerAttention
from .step import DecodeBlocks, PagedStep, SeqSlice
from .varlen import PackedChunks, VarlenAttention


@dataclass(slots=True)
class _Chunk:
    start: int
    """First packed row."""
    end: int
    blocks: torch.Tensor | None
    """Blocks holding the context the chunk sees; ``None`` when it sees only its own new keys."""
    mask: torch.Tensor | None
    """``[chunk, context]`` visibility; ``None`` for plain causal attention over its own keys."""


@dataclass(slots=True)
class _Decodes:
    rows: torch.Tensor | None
    """Packed row of each decode; ``None`` when the step is all decodes, in order."""
    blocks: DecodeBlocks
    """What each decode sees: the kernel's input, and the eager gather's blocks."""
    visible: torch.Tensor | None
    """``[decodes, width * block_size]`` which of the gathered slots each decode sees, for the eager gather (without
    the kernel)."""


@dataclass(slots=True)
class _Views:
    """What the layers of one window size read, built once per step."""

    decodes: _Decodes | None
    packed_chunks: PackedChunks | None
    """The prefill chunks laid out for one varlen call (when the backend has one and there are chunks)."""


class GatherBuffers:
    """Reused destination of the K/V gathers: a fresh multi-MB tensor per layer and step costs more in page faults
    than the copy itself (measured 35 ms vs 5 ms for 52 MB on CPU). Layers run one after another, so one K and one V
    buffer serve them all."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        key = (name, like.device, like.dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[key] = buffer
        return buffer[:numel]


class GatherBackend:
    def __init__(self, decode_kernel: DecodeKernel | None, varlen: VarlenAttention | None = None) -> None:
        self.buffers = GatherBuffers()
        self.decode_kernel = decode_kernel
        """The fast in-place decode attention; ``None`` gathers the decodes' contexts eagerly."""
        self.varlen = varlen
        """The prefill chunks' one call; ``None`` attends them one call each."""

    @property
    def paths(self) -> list[FastPath]:
        return [part.path for part in (self.decode_kernel, self.varlen) if part is not None]

    def attend(
        self,
        step: PagedStep,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: LayerAttention,
    ) -> torch.Tensor:
        views: _Views = step.memo(
            ("gather", layer.window),
            lambda: _build_views(step, layer.window, self.decode_kernel is not None, self.varlen is not None),
        )
        k_cache, v_cache = step.cache.k[layer_index], step.cache.v[layer_index]
        device, bs = k_cache.device, step.cache.block_size  # device differs from the step's only under device_map
        q = query[0].transpose(0, 1)  # [T, H, D]
        decodes = views.decodes
        if decodes is not None and decodes.rows is None:  # all decodes: no rows to pick or scatter
            return self._decode(q, k_cache, v_cache, decodes, bs, layer)
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
        if decodes is not None:
            assert decodes.rows is not None
            rows = decodes.rows.to(device)
            out[rows] = self._decode(q[rows], k_cache, v_cache, decodes, bs, layer)
        packed, varlen = views.packed_chunks, self.varlen
        if (
            packed is not None
            and varlen is not None
            and packed.slots.device == device
            and varlen.supports(q, k_cache, v_cache, layer)
        ):
            try:
                result = varlen(q, k_cache, v_cache, packed, layer)
            except Exception as exc:
                self._chunks(step, out, query, key, value, k_cache, v_cache, layer)  # the inputs' own fault raises
                varlen.path.switch_off(f"{type(exc).__name__}: {exc}")
                return out
            if varlen.trusted(packed):
                out[packed.rows] = result
                return out
            self._chunks(step, out, query, key, value, k_cache, v_cache, layer)
            varlen.check(packed, result, out[packed.rows])
            return out
        self._chunks(step, out, query, key, value, k_cache, v_cache, layer)
        return out

    def _chunks(
        self,
        step: PagedStep,
        out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layer: LayerAttention,
    ) -> None:
        """Each prefill chunk in its own call, into ``out``."""
        device, bs, window = k_cache.device, step.cache.block_size, layer.window
        chunks: list[_Chunk] = step.memo(  # once a step and window, and only where chunks attend one by one
            ("gather-chunks", window),
            lambda: [_chunk_view(step, s, window) for s in step.seqs if s.num_tokens > 1],
        )
        for chunk in chunks:
            qp = query[:, :, chunk.start : chunk.end]
            if chunk.blocks is None:
                kp, vp = key[:, :, chunk.start : chunk.end], value[:, :, chunk.start : chunk.end]
            else:
                blocks = chunk.blocks.to(device).unsqueeze(0)
                kp = _gather(
                    k_cache, blocks, bs, self.buffers.get("k", blocks.numel() * bs * _row_numel(k_cache), k_cache)
                )
                vp = _gather(
                    v_cache, blocks, bs, self.buffers.get("v", blocks.numel() * bs * _row_numel(v_cache), v_cache)
                )
            mask = None if chunk.mask is None else chunk.mask.to(device)
            out[chunk.start : chunk.end] = attend(qp, kp, vp, layer, mask)[0].transpose(0, 1)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        decodes: _Decodes,
        bs: int,
        layer: LayerAttention,
    ) -> torch.Tensor:
        device = k_cache.device  # differs from the step's only under device_map
        if self.decode_kernel is not None:
            return self.decode_kernel(q, k_cache, v_cache, decodes.blocks.to(device), layer)
        assert decodes.visible is not None
        blocks = decodes.blocks.tables.to(device)
        kd = _gather(k_cache, blocks, bs, self.buffers.get("k", blocks.numel() * bs * _row_numel(k_cache), k_cache))
        vd = _gather(v_cache, blocks, bs, self.buffers.get("v", blocks.numel() * bs * _row_numel(v_cache), v_cache))
        return attend(q.unsqueeze(2), kd, vd, layer, decodes.visible[:, None, None, :].to(device)).squeeze(2)


def _row_numel(cache: torch.Tensor) -> int:
    return cache.shape[0] * cache.shape[2]


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """``[*blocks.shape[:-1], kv_heads, blocks * block_size, dim]``, each head's rows contiguous (SDPA reads that
    2.3x faster on CPU than the position-major layout)."""
    heads, _, dim = cache.shape
    by_block = cache.view(heads, -1, block_size * dim)
    gathered = torch.index_select(by_block, 1, blocks.flatten(), out=out.view(heads, blocks.numel(), block_size * dim))
    context = blocks.shape[-1] * block_size
    return gathered.view(heads, *blocks.shape[:-1], context, dim).movedim(0, -3)


def _build_views(step: PagedStep, window: int | None, with_kernel: bool, with_packed_chunks: bool) -> _Views:
    bs, device = step.cache.block_size, step.device
    decodes = [s for s in step.seqs if s.num_tokens == 1]
    chunks = [s for s in step.seqs if s.num_tokens > 1]
    # A chunk whose image tokens attend both ways needs its own mask: the step's chunks attend one by one.
    together = with_packed_chunks and chunks and not any(s.spans for s in chunks)
    packed = PackedChunks.build(step, chunks, window) if together else None
    if not decodes:
        return _Views(None, packed)
    rows = None if len(decodes) == len(step.seqs) else indices([s.row for s in decodes], device)
    blocks = DecodeBlocks.build(decodes, window, bs, step.block_tables)
    visible = None if with_kernel else to_device(blocks.visible(), device)
    return _Views(_Decodes(rows, blocks.to(device), visible), packed)


def _chunk_view(step: PagedStep, seq: SeqSlice, window: int | None) -> _Chunk:
    start, end, bs, device = seq.row, seq.row + seq.num_tokens, step.cache.block_size, step.device
    spans = seq.spans if window is not None or not step.spans_on_sliding_only else ()
    if seq.start == 0:
        own = None if window is None or window >= seq.num_tokens else causal_mask(seq.num_tokens, 0, window, device)
        if spans:
            own = both_ways(causal_mask(seq.num_tokens, 0, window, device), seq.start, spans, window)
        return _Chunk(start, end, None, own)
    first_block = first_visible(seq.start, window) // bs
    blocks = torch.from_numpy(step.blocks(seq, first_block))
    mask = causal_mask(seq.num_tokens, seq.start, window, device)
    if spans:
        mask = both_ways(mask, seq.start, spans, window)
    mask = mask[:, first_block * bs :]
    width = len(blocks) * bs
    if mask.shape[1] < width:  # the last block is only partly filled: its tail is not visible
        mask = torch.nn.functional.pad(mask, (0, width - mask.shape[1]))
    return _Chunk(start, end, to_device(blocks, device), mask)
