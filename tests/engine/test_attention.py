"""The attention backends against a plain per-sequence reference, on packed steps built by hand.

A step mixes decodes, prefills from position 0 and prefill chunks that continue a cached context, over block tables
that share prefix blocks; layers ask for sliding windows, soft-caps and sinks. Every backend (gather eager, gather
with the compiled in-place decode kernel, flex) must give what attending each sequence's queries over its own
contiguous context gives.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from batchgen.server.engine.attention import PagedStep, SeqSlice, make_backend
from batchgen.server.engine.attention.flex import Q_BLOCK, _block_mask
from batchgen.server.engine.attention.kernels import attend, causal_mask
from batchgen.server.engine.attention.layer import LayerAttention
from batchgen.server.engine.kv_cache import KVCache, LayerShape

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4
LAYERS = {
    "plain": LayerAttention(None, None, None, None),
    "window": LayerAttention(None, 5, None, None),
    "softcap": LayerAttention(0.9, None, 1.5, None),
    "window+softcap": LayerAttention(0.9, 3, 1.5, None),
    "sinks": LayerAttention(None, 6, None, torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)),
}
# (tokens already cached, new tokens): decodes, prefills from 0, chunks continuing a context, a one-token chunk.
SHAPES = [(9, 1), (0, 7), (12, 6), (0, 1), (23, 1), (4, 11), (30, 1), (16, 3)]
DECODES = [(9, 1), (0, 1), (23, 1), (30, 1), (3, 1)]
"""A step of decodes alone (the decode kernel then takes the packed rows as they are)."""
BACKENDS = {
    "gather": lambda: make_backend("gather", torch.device("cpu"), compiled=False),
    "gather-compiled": lambda: COMPILED_GATHER,
    "flex": lambda: make_backend("flex", torch.device("cpu"), compiled=False),
}
COMPILED_GATHER = make_backend("gather", torch.device("cpu"), compiled=True)
"""One for the module, so that each kind of layer is compiled once."""


def _step(
    seed: int, shapes: list[tuple[int, int]] = SHAPES
) -> tuple[PagedStep, KVCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cache = KVCache([LayerShape(KV_HEADS, DIM, DIM, torch.float64, torch.device("cpu"))], 64, BLOCK)
    free = list(range(1, 64))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(2)]  # two full blocks of prefix every long-enough sequence shares
    cache.k[0].normal_()
    cache.v[0].normal_()
    seqs, slots, row = [], [], 0
    for start, n in shapes:
        total = -(-(start + n) // BLOCK)
        table = shared[: min(2, start // BLOCK)]
        table += [free.pop() for _ in range(total - len(table))]
        seqs.append(SeqSlice(row, n, start, table))
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
        row += n
    query = torch.randn(1, HEADS, row, DIM, dtype=torch.float64)
    key = torch.randn(1, KV_HEADS, row, DIM, dtype=torch.float64)
    value = torch.randn(1, KV_HEADS, row, DIM, dtype=torch.float64)
    step = PagedStep(cache, BACKENDS["gather"](), seqs, torch.tensor(slots), torch.device("cpu"))
    return step, cache, query, key, value


def _reference(cache: KVCache, seq: SeqSlice, query: torch.Tensor, layer: LayerAttention) -> torch.Tensor:
    """The sequence's queries over its whole context, contiguous, with the plain causal (+ window) mask."""
    positions = torch.arange(seq.end)
    slots = torch.tensor(seq.block_table)[positions // BLOCK] * BLOCK + positions % BLOCK
    keys, values = cache.k[0][:, slots].unsqueeze(0), cache.v[0][:, slots].unsqueeze(0)
    q = query[:, :, seq.row : seq.row + seq.num_tokens]
    mask = causal_mask(seq.num_tokens, seq.start, layer.window, q.device)
    return attend(q, keys, values, layer, mask)[0].transpose(0, 1)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("shapes", [SHAPES, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("layer_name", sorted(LAYERS))
def test_backend_matches_per_sequence_reference(backend: str, layer_name: str, shapes: list[tuple[int, int]]) -> None:
    layer = LAYERS[layer_name]
    step, cache, query, key, value = _step(len(layer_name), shapes)
    step.backend = BACKENDS[backend]()
    out = step.attend(query, key, value, layer)
    for seq in step.seqs:
        expected = _reference(cache, seq, query, layer)
        torch.testing.assert_close(out[seq.row : seq.row + seq.num_tokens], expected, rtol=1e-9, atol=1e-9)
    assert COMPILED_GATHER.decode_kernel.failure is None  # it ran compiled, not through its eager fallback


@pytest.mark.parametrize("window", [None, 5, 1])
def test_flex_block_mask_lists_exactly_the_visible_blocks(window: int | None) -> None:
    step, *_ = _step(seed=3)
    mask = _block_mask(step, window)
    tokens, slots = step.slot_mapping.shape[0], step.cache.num_blocks * BLOCK
    visible = create_mask(mask.mask_mod, None, None, tokens, slots, device="cpu")[0, 0]
    groups = -(-tokens // Q_BLOCK)
    padded = torch.nn.functional.pad(visible, (0, 0, 0, groups * Q_BLOCK - tokens))
    needed = padded.view(groups, Q_BLOCK, -1, BLOCK).any(dim=3).any(dim=1)  # [groups, cache blocks]
    listed = mask.to_dense()[0, 0, :groups].bool()
    assert torch.equal(listed, needed)
    # And the mask itself: each query sees exactly its own sequence's causal (+ window) positions.
    for seq in step.seqs:
        for i in range(seq.num_tokens):
            position = seq.start + i
            first = 0 if window is None else max(0, position - window + 1)
            expected = {seq.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(first, position + 1)}
            assert set(visible[seq.row + i].nonzero().flatten().tolist()) == expected
