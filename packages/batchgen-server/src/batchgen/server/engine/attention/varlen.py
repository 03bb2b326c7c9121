"""A step's prefill chunks in one attention call: flash attention over variable-length sequences, on CUDA.

The gather backend attends each prefill chunk in its own SDPA call per layer; on a GPU each call costs far more host
time than device time (``benchmarks/RESULTS.md``: 124 us of CPU a call for a few us of work). Here every chunk of a
step attends in one call of ``torch.nn.attention.varlen.varlen_attn``: the chunks' queries picked from the packed
row, their contexts' keys and values gathered from the cache back to back, each chunk's span given by cumulative
lengths. Flash attention aligns its causal (and sliding-window) mask to the bottom right when a sequence has more
keys than queries: a chunk's queries are the last positions of its context, as a chunk continuing a cached prompt
needs. It computes neither soft-caps nor sinks and runs in 16-bit floats only: other layers keep the per-chunk path.

The first call of each kind (per window size: chunks that start their sequence or continue a cached context, and
contexts within or beyond the window) is checked against the per-chunk path on the same step; if the two disagree,
or a call fails (an older GPU, a head size flash does not take, memory), the backend keeps the per-chunk path from
then on, saying why once in the log.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..ops.fast_paths import FastPath
from ..ops.transfer import to_device
from .decode import first_visible
from .layer import LayerAttention
from .step import PagedStep, SeqSlice

VarlenCall = Callable[..., Any]
"""``varlen_attn``'s signature: ``(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size,
enable_gqa)`` with ``query`` ``[Tq, H, D]`` and ``key``/``value`` ``[Tk, KVH, D]``; returns ``[Tq, H, D]``."""


@dataclass(frozen=True, slots=True)
class PackedChunks:
    """A step's prefill chunks laid out for one call (built once a step and window size)."""

    rows: torch.Tensor
    """``[Tq]`` the packed rows of the chunks' queries, chunk after chunk."""
    slots: torch.Tensor
    """``[Tk]`` the cache slots of each chunk's visible context (its new tokens' included), chunk after chunk."""
    cu_q: torch.Tensor
    """``[C + 1]`` int32: chunk ``i``'s queries are ``rows[cu_q[i]:cu_q[i + 1]]``."""
    cu_k: torch.Tensor
    """``[C + 1]`` int32: its keys are ``slots[cu_k[i]:cu_k[i + 1]]``."""
    max_q: int
    max_k: int
    kind: tuple[int | None, bool, bool]
    """What the first-use check tells apart: the window, whether a chunk continues a cached context, whether a
    context reaches past the window."""

    @classmethod
    def build(cls, step: PagedStep, chunks: list[SeqSlice], window: int | None) -> PackedChunks:
        block_size, device = step.cache.block_size, step.device
        rows, slots, q_lens, k_lens = [], [], [], []
        continues = beyond_window = False
        for chunk in chunks:
            continues |= chunk.start > 0
            beyond_window |= window is not None and chunk.end > window
            rows.append(np.arange(chunk.row, chunk.row + chunk.num_tokens))
            first = first_visible(chunk.start, window)  # the first position any of its queries sees
            positions = np.arange(first, chunk.end)
            slots.append(step.blocks(chunk)[positions // block_size] * block_size + positions % block_size)
            q_lens.append(chunk.num_tokens)
            k_lens.append(len(positions))
        cu = np.zeros((2, len(chunks) + 1), dtype=np.int32)
        cu[0, 1:], cu[1, 1:] = np.cumsum(q_lens), np.cumsum(k_lens)
        indices = to_device(torch.from_numpy(np.concatenate([*rows, *slots])), device)
        total_q = int(cu[0, -1])
        cu_device = to_device(torch.from_numpy(cu), device)
        kind = (window, continues, beyond_window)
        return cls(indices[:total_q], indices[total_q:], cu_device[0], cu_device[1], max(q_lens), max(k_lens), kind)


def flash_varlen() -> VarlenCall | None:
    """torch's ``varlen_attn``, where this build has it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    call: VarlenCall = varlen_attn
    return call


class VarlenAttention:
    """The chunks of a step in one call (``call``: ``varlen_attn`` on CUDA; the tests give a plain reference)."""

    def __init__(
        self,
        call: VarlenCall,
        dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16),
        verify: bool = True,
    ) -> None:
        self.call = call
        self.dtypes = dtypes
        self.verify = verify
        """Whether each kind of call is first checked against the per-chunk path."""
        self.checked: set[tuple[int | None, bool, bool]] = set()
        """The kinds of call (``PackedChunks.kind``) that agreed with the per-chunk path."""
        self.path = FastPath("varlen attention")
        """Off (the per-chunk path serves) once a call failed or disagreed with it."""

    def supports(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: LayerAttention
    ) -> bool:
        head_dim = query.shape[-1]
        return (
            self.path.on
            and query.dtype in self.dtypes
            and k_cache.dtype == v_cache.dtype == query.dtype
            and not layer.needs_explicit_scores
            and v_cache.shape[-1] == head_dim <= 256
            and head_dim % 8 == 0
        )

    def trusted(self, chunks: PackedChunks) -> bool:
        """Whether a call of this kind may serve without the per-chunk path beside it."""
        return not self.verify or chunks.kind in self.checked

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunks: PackedChunks,
        layer: LayerAttention,
    ) -> torch.Tensor:
        """``query`` ``[T, H, D]`` (the packed row); caches ``[KVH, slots, D]``. Returns ``[Tq, H, D]``, the rows
        ``chunks.rows``."""
        keys = k_cache.transpose(0, 1)[chunks.slots]  # [Tk, KVH, D], contiguous
        values = v_cache.transpose(0, 1)[chunks.slots]
        window = (-1, 0) if layer.window is None else (layer.window - 1, 0)  # (left, right): causal, and the window
        out: torch.Tensor = self.call(
            query[chunks.rows],
            keys,
            values,
            chunks.cu_q,
            chunks.cu_k,
            chunks.max_q,
            chunks.max_k,
            scale=layer.scale,
            window_size=window,
            enable_gqa=query.shape[1] != k_cache.shape[0],
        )
        return out

    def check(self, chunks: PackedChunks, result: torch.Tensor, expected: torch.Tensor) -> None:
        """The first call of a kind against the per-chunk path's ``expected``; turn this off if they disagree."""
        if torch.allclose(result.float(), expected.float(), rtol=3e-2, atol=3e-2):
            self.checked.add(chunks.kind)
            return
        error = (result.float() - expected.float()).abs().max().item()
        window, continues, beyond = chunks.kind
        kind = f"window {window}, {'continuing' if continues else 'new'} chunks{', past the window' if beyond else ''}"
        self.path.switch_off(f"it disagrees with per-chunk attention ({kind}: largest difference {error:.3g})")
