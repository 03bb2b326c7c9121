"""The attention backends against a plain per-sequence reference, on packed steps built by hand.

A step mixes decodes, prefills from position 0 and prefill chunks that continue a cached context, over block tables
that share prefix blocks; layers ask for sliding windows, soft-caps and sinks. Every backend (gather eager, gather
with the fast in-place decode kernel, gather with its prefill chunks in one varlen call, flex) must give what
attending each sequence's queries over its own contiguous context gives. The compiled gather's decodes run the C++
kernel, which reads float32 and bfloat16 caches. The varlen call is flash attention on CUDA; here a plain
implementation of its contract (``reference_varlen``) stands in, so what is checked is how the chunks are laid out
for it, and what the backend does when the call fails or disagrees.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

from batchgen.server.engine import EngineRequest, EngineResult, LLMEngine, SamplingParams
from batchgen.server.engine.attention import DecodeBlocks, PagedStep, SeqSlice, cpu_decode, decode, make_backend
from batchgen.server.engine.attention.flex import Q_BLOCK, _block_mask
from batchgen.server.engine.attention.gather import GatherBackend
from batchgen.server.engine.attention.kernels import attend, causal_mask
from batchgen.server.engine.attention.kv_cache import KVCache, LayerShape
from batchgen.server.engine.attention.layer import LayerAttention
from batchgen.server.engine.attention.varlen import VarlenAttention
from batchgen.server.engine.ops import native

Run = Callable[[LLMEngine, list[EngineRequest]], dict[str, EngineResult]]

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


def reference_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None,
    window_size: tuple[int, int],
    enable_gqa: bool,
) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn``'s contract, sequence by sequence: query ``i`` of a sequence with
    ``Lq`` queries and ``Lk`` keys sits at key position ``i + Lk - Lq`` (the mask aligned bottom right) and sees the
    keys from ``window_size[0]`` before it (all, if negative) to ``window_size[1]`` after it."""
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32
    q_lens, k_lens = cu_seq_q.diff().tolist(), cu_seq_k.diff().tolist()
    assert (max_q, max_k) == (max(q_lens), max(k_lens))
    left, right = window_size
    out = []
    for i in range(len(q_lens)):
        q = query[cu_seq_q[i] : cu_seq_q[i + 1]].transpose(0, 1)
        k, v = (t[cu_seq_k[i] : cu_seq_k[i + 1]].transpose(0, 1) for t in (key, value))
        at = torch.arange(q_lens[i]).unsqueeze(1) + k_lens[i] - q_lens[i]
        keys = torch.arange(k_lens[i]).unsqueeze(0)
        visible = (keys <= at + right) & ((keys >= at - left) if left >= 0 else True)
        out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=enable_gqa))
    return torch.cat(out, dim=1).transpose(0, 1)


def _varlen_gather(call: object = reference_varlen, verify: bool = False) -> GatherBackend:
    """Gather with the varlen call, unchecked by default: its own output serves from the first step."""
    return GatherBackend(None, VarlenAttention(call, dtypes=(torch.float64,), verify=verify))  # type: ignore[arg-type]


def _paged_decode_gather() -> GatherBackend:
    """Gather whose decodes run ``paged_decode`` (the kernels' reference and the fallback) in float64."""
    kernel = decode.DecodeKernel()
    kernel.path.switch_off("the test runs the plain version")
    return GatherBackend(kernel)


BACKENDS = {
    "gather": lambda: make_backend("gather", torch.device("cpu"), compiled=False),
    "gather-paged-decode": _paged_decode_gather,
    "gather-compiled": lambda: COMPILED_GATHER,
    "gather-varlen": _varlen_gather,
    "flex": lambda: make_backend("flex", torch.device("cpu"), compiled=False),
}
COMPILED_GATHER = make_backend("gather", torch.device("cpu"), compiled=True)
"""One for the module, so that each kind of layer is compiled once."""
PRECISION = {"gather-compiled": (torch.float32, 1e-5)}
"""The dtype a backend runs in here (and the tolerance against the float64 reference) if not float64 and 1e-9."""


def _step(
    seed: int,
    shapes: list[tuple[int, int]] = SHAPES,
    dtype: torch.dtype = torch.float64,
    heads: tuple[int, int, int] = (HEADS, KV_HEADS, DIM),
    block: int = BLOCK,
) -> tuple[PagedStep, KVCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed step over a cache of ``heads`` (query heads, KV heads, head size) and ``block``-slot blocks holding
    random keys and values."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_heads, kv_heads, dim = heads
    num_blocks = 128
    cache = KVCache([LayerShape(kv_heads, dim, dim, dtype, torch.device("cpu"))], num_blocks, block)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(2)]  # two full blocks of prefix every long-enough sequence shares
    cache.k[0].normal_()
    cache.v[0].normal_()
    seqs, slots, row = [], [], 0
    tables = np.zeros((len(shapes), max(-(-(start + n) // block) for start, n in shapes)), dtype=np.int64)
    for i, (start, n) in enumerate(shapes):
        total = -(-(start + n) // block)
        table = shared[: min(2, start // block)]
        table += [free.pop() for _ in range(total - len(table))]
        tables[i, :total] = table
        seqs.append(SeqSlice(row, n, start, i))
        slots += [table[p // block] * block + p % block for p in range(start, start + n)]
        row += n
    query = torch.randn(1, num_heads, row, dim, dtype=dtype)
    key = torch.randn(1, kv_heads, row, dim, dtype=dtype)
    value = torch.randn(1, kv_heads, row, dim, dtype=dtype)
    step = PagedStep(cache, BACKENDS["gather"](), seqs, tables, torch.tensor(slots), torch.device("cpu"))
    return step, cache, query, key, value


def _reference(step: PagedStep, seq: SeqSlice, query: torch.Tensor, layer: LayerAttention) -> torch.Tensor:
    """The sequence's queries over its whole context, contiguous, with the plain causal (+ window) mask."""
    positions = torch.arange(seq.end)
    slots = torch.from_numpy(step.blocks(seq))[positions // BLOCK] * BLOCK + positions % BLOCK
    cache = step.cache
    keys, values = cache.k[0][:, slots].unsqueeze(0).double(), cache.v[0][:, slots].unsqueeze(0).double()
    q = query[:, :, seq.row : seq.row + seq.num_tokens].double()
    mask = causal_mask(seq.num_tokens, seq.start, layer.window, q.device)
    return attend(q, keys, values, layer, mask)[0].transpose(0, 1)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("shapes", [SHAPES, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("layer_name", sorted(LAYERS))
def test_backend_matches_per_sequence_reference(
    backend: str, layer_name: str, shapes: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = LAYERS[layer_name]
    dtype, tolerance = PRECISION.get(backend, (torch.float64, 1e-9))
    step, _, query, key, value = _step(len(layer_name), shapes, dtype)
    step.backend = BACKENDS[backend]()
    if backend == "gather-compiled":  # its decodes must run the C++ kernel, not the eager fallback
        monkeypatch.setattr(decode, "paged_decode", _must_not_run)
    out = step.attend(query, key, value, layer)
    for seq in step.seqs:
        expected = _reference(step, seq, query, layer)
        torch.testing.assert_close(
            out[seq.row : seq.row + seq.num_tokens].double(), expected, rtol=tolerance, atol=tolerance
        )
    assert COMPILED_GATHER.decode_kernel.path.on


def _must_not_run(*args: object) -> None:
    raise AssertionError("the decode attention ran eagerly")


@pytest.mark.parametrize("window", [None, 1, 5, 16])
@pytest.mark.parametrize("block", [1, BLOCK, 5])
def test_decode_blocks_name_each_visible_slot_once(window: int | None, block: int) -> None:
    """``DecodeBlocks.build`` (cut from the block tables every step) against the definition, position by position:
    the slots decode ``i``'s row and bounds make visible are exactly those of its table holding positions
    ``first_visible`` to its own, whatever else the tables hold (rows in any order, stale blocks past each table's
    end); ``visible`` (the eager gather's mask) marks the same slots."""
    rng = random.Random(block * 100 + (window or 0))
    starts = [0, 1, block - 1, block, 3 * block + 2, *(rng.randrange(60) for _ in range(8))]
    pool = rng.sample(range(1000), 400)
    tables = np.array([[rng.randrange(1000) for _ in range(64)] for _ in range(len(starts) + 3)])  # stale blocks
    table_rows = rng.sample(range(len(tables)), len(starts))
    decodes, own_tables = [], []
    for row, start in enumerate(starts):
        table = [pool.pop() for _ in range(start // block + 1 + rng.randrange(3))]  # spare blocks at the end
        tables[table_rows[row], : len(table)] = table
        own_tables.append(table)
        decodes.append(SeqSlice(row, 1, start, table_rows[row]))
    blocks = DecodeBlocks.build(decodes, window, block, tables)
    assert blocks.tables.shape[1] == max(
        s.start // block - decode.first_visible(s.start, window) // block + 1 for s in decodes
    )
    positions, visible = blocks.positions(), blocks.visible()
    for i, (seq, table) in enumerate(zip(decodes, own_tables, strict=True)):
        expected = [
            (table[p // block], p % block) for p in range(decode.first_visible(seq.start, window), seq.start + 1)
        ]
        assert (blocks.first[i], blocks.last[i]) == (decode.first_visible(seq.start, window), seq.start)
        seen = (positions[i] >= blocks.first[i]) & (positions[i] <= blocks.last[i])
        listed = [(int(blocks.tables[i, j // block]), j % block) for j in seen.nonzero().flatten().tolist()]
        assert listed == expected
        assert torch.equal(visible[i], seen)


@pytest.mark.parametrize("layer_name", sorted(LAYERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(7, 1, 64), (8, 2, 20)], ids=["7-per-kv-head-dim-64", "4-per-kv-head-dim-20"])
@pytest.mark.parametrize("block", [BLOCK, 5])
def test_cpu_decode_kernel(layer_name: str, dtype: torch.dtype, heads: tuple[int, int, int], block: int) -> None:
    """The C++ kernel against ``paged_decode`` (the plain tensor version, in float64) on the shapes its loops treat
    apart: query heads in groups of four and one by one, a head size that is not a multiple of the vector width, an
    odd block size, bfloat16 caches, a context of several of its chunks (128 slots), windows that start inside a
    block; and the same result, to the bit, on two threads."""
    q, k_cache, v_cache, blocks, args, expected = _decode_case(
        5, [*DECODES, (40, 1), (300, 1), (2, 1)], layer_name, heads, block, dtype
    )
    out = cpu_decode.paged_decode(q, k_cache, v_cache, blocks, *args)
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # the output's own rounding to bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(cpu_decode.paged_decode(q, k_cache, v_cache, blocks, *args), out)
    finally:
        torch.set_num_threads(threads)


def test_cpu_decode_kernel_refuses_what_it_cannot_read() -> None:
    """The operator checks what its loops read, the block ids included, and says what is wrong."""
    q, k_cache, v_cache, blocks, args, _ = _decode_case(5, DECODES, "plain", (8, 2, 20), BLOCK, torch.float32)
    outside = blocks.tables.clone()
    outside[1, 0] = k_cache.shape[1] // BLOCK
    cases = {
        "decode 1 reads block": (k_cache, v_cache, dataclasses.replace(blocks, tables=outside)),
        "more than its": (k_cache, v_cache, dataclasses.replace(blocks, last=blocks.last + BLOCK * 8)),
        "contiguous int64": (k_cache, v_cache, dataclasses.replace(blocks, first=blocks.first.int())),
        "both float32 or both bfloat16": (k_cache, v_cache.bfloat16(), blocks),
        "caches must be contiguous": (k_cache, v_cache.transpose(0, 1).contiguous().transpose(0, 1), blocks),
    }
    for message, (k, v, seen) in cases.items():
        with pytest.raises(RuntimeError, match=message):
            cpu_decode.paged_decode(q, k, v, seen, *args)


def test_paged_decode_in_groups_gives_what_it_gives_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``paged_decode`` gathers its decodes in groups when their padded rows would take too much memory at once."""
    layer = LAYERS["sinks"]
    step, cache, query, key, value = _step(7, [*DECODES, (40, 1), (2, 1)])
    cache.write(0, step.slot_mapping, key[0], value[0])
    blocks = DecodeBlocks.build(step.seqs, layer.window, BLOCK, step.block_tables)
    q, args = query[0].transpose(0, 1), (layer.sinks, 0.7, 1.5)
    at_once = decode.paged_decode(q, cache.k[0], cache.v[0], blocks, *args)
    for elements in (1, 3 * KV_HEADS * blocks.tables.shape[1] * BLOCK * DIM):  # one decode a group; three
        monkeypatch.setattr(decode, "GATHER_ELEMENTS", elements)
        assert torch.equal(decode.paged_decode(q, cache.k[0], cache.v[0], blocks, *args), at_once)


def test_triton_decode_kernel_in_its_interpreter() -> None:
    """The CUDA decode kernel (``triton_decode.py``), run by Triton's interpreter on the CPU, against
    ``paged_decode`` on ``test_cpu_decode_kernel``'s shapes: its splits' partials, combined, whatever the number of
    splits (more than a decode has blocks too). Opt-in: CPU-only torch brings no Triton, and the interpreter must be
    on before Triton is first imported, so it runs with ``TRITON_INTERPRET=1`` and Triton installed
    (docs/engine.md), and skips otherwise."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 (with Triton installed) to run the CUDA kernel in Triton's interpreter")
    triton_decode = pytest.importorskip("batchgen.server.engine.attention.triton_decode")
    for layer_name, heads, block in itertools.product(sorted(LAYERS), [(7, 1, 64), (8, 2, 20)], [BLOCK, 5]):
        case = _decode_case(6, [*DECODES, (40, 1), (2, 1)], layer_name, heads, block, torch.float32)
        q, k_cache, v_cache, blocks, (sinks, scale, softcap), expected = case
        for splits in (1, 3, 16):
            partials = triton_decode.split_partials(q.contiguous(), k_cache, v_cache, blocks, scale, softcap, splits)
            out = decode.combine(*partials, q, sinks)
            torch.testing.assert_close(
                out.double(), expected, rtol=1e-5, atol=1e-5, msg=f"{layer_name}, {heads}, {block}, {splits} splits"
            )


def _decode_case(
    seed: int,
    shapes: list[tuple[int, int]],
    layer_name: str,
    heads: tuple[int, int, int],
    block: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeBlocks, tuple[Any, float, Any], torch.Tensor]:
    """A step of decodes alone, their keys and values in the cache, for a decode kernel: the queries ``[B, H, D]``,
    the caches, what the decodes see, the layer's (sinks, scale, soft-cap), and ``paged_decode``'s output in
    float64 (a sinks layer's sinks widened to ``heads``)."""
    layer = LAYERS[layer_name]
    if layer.sinks is not None:
        layer = LayerAttention(layer.scale, layer.window, None, torch.linspace(-1, 2, heads[0], dtype=torch.float64))
    step, cache, query, key, value = _step(seed, shapes, dtype, heads, block)
    cache.write(0, step.slot_mapping, key[0], value[0])
    blocks = DecodeBlocks.build(step.seqs, layer.window, block, step.block_tables)
    q, k_cache, v_cache = query[0].transpose(0, 1), cache.k[0], cache.v[0]
    args = (layer.sinks, layer.scale or heads[2] ** -0.5, layer.softcap)
    expected = decode.paged_decode(q.double(), k_cache.double(), v_cache.double(), blocks, *args)
    return q, k_cache, v_cache, blocks, args, expected


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
            table = step.blocks(seq)
            expected = {table[p // BLOCK] * BLOCK + p % BLOCK for p in range(first, position + 1)}
            assert set(visible[seq.row + i].nonzero().flatten().tolist()) == expected


def test_the_decode_kernel_without_a_compiler_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A CPU with no working C++ compiler (here: one that fails, and no library built before) still decodes: the
    kernel says why once and runs ``paged_decode`` from then on."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    native._loaded.cache_clear()
    try:
        step, _, query, key, value = _step(2, DECODES, torch.float32)
        kernel = decode.DecodeKernel()
        step.backend = GatherBackend(kernel)
        out = step.attend(query, key, value, LAYERS["plain"])
        assert kernel.path.off is not None and "failed to build cpu_decode.cpp" in kernel.path.off
        assert "decode kernel: off from now on, the plain path serves" in caplog.text
        for seq in step.seqs:
            expected = _reference(step, seq, query, LAYERS["plain"])
            torch.testing.assert_close(out[seq.row : seq.row + 1].double(), expected, rtol=1e-5, atol=1e-5)
    finally:
        native._loaded.cache_clear()  # the next test builds (or finds) the real one


@pytest.mark.parametrize("layer_name", ["plain", "window"])
def test_varlen_call_is_checked_on_first_use(layer_name: str, caplog: pytest.LogCaptureFixture) -> None:
    """The first varlen call of each kind runs beside the per-chunk path and must agree with it; one that disagrees
    or raises is turned off for good (the reason logged once), and the step's output is the per-chunk path's."""
    layer = LAYERS[layer_name]

    def off_by_one_window(*args: Any, **kwargs: Any) -> torch.Tensor:
        left, right = kwargs["window_size"]
        return reference_varlen(*args, **{**kwargs, "window_size": (left + 2 if left >= 0 else 1, right)})

    def raising(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")

    for call, agrees in ((reference_varlen, True), (off_by_one_window, False), (raising, False)):
        step, _, query, key, value = _step(4)
        step.backend = backend = _varlen_gather(call, verify=True)
        assert backend.varlen is not None
        for _ in range(2):  # the first step checks; the second runs the call alone, or the per-chunk path
            out = step.attend(query, key, value, layer)
            step.layers_attended = 0
            for seq in step.seqs:
                expected = _reference(step, seq, query, layer)
                torch.testing.assert_close(out[seq.row : seq.row + seq.num_tokens].double(), expected)
        # SHAPES holds chunks that continue a context, and contexts past the 5-token window.
        assert backend.varlen.checked == ({(layer.window, True, layer.window is not None)} if agrees else set())
        assert backend.varlen.path.on == agrees
    assert "disagrees with per-chunk attention" in caplog.text and "Ampere" in caplog.text


def test_each_kind_of_varlen_call_is_checked_once() -> None:
    """A step of new chunks alone, then one with a chunk continuing a context: each kind is checked when first met."""
    backend = _varlen_gather(verify=True)
    assert backend.varlen is not None
    for shapes, kinds in (([(0, 7), (0, 3)], 1), ([(0, 7), (0, 3)], 1), ([(0, 7), (12, 6)], 2)):
        step, _, query, key, value = _step(6, shapes)
        step.backend = backend
        step.attend(query, key, value, LAYERS["plain"])
        assert len(backend.varlen.checked) == kinds and backend.varlen.path.on


def test_varlen_chunks_in_the_engine(
    make_engine: Callable[..., LLMEngine], random_prompts: Callable[..., list[list[int]]], run_to_completion: Run
) -> None:
    """Through the engine: prompts prefilled in chunks beside decodes (a small step budget), some continuing a
    prefix-cache hit, attended in one varlen call a step give the tokens and logprobs of chunks attended one by one."""
    prompts = random_prompts(10, 5, 60, seed=21)
    prompts[3] = [*prompts[0][:40], 9]  # its first blocks come from the cache: its chunks continue a context
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2)
    outputs = []
    for varlen in (False, True):
        engine = make_engine(max_num_batched_tokens=24, block_size=4)
        if varlen:
            engine.runner.backend = backend = _varlen_gather()
        results = run_to_completion(engine, [EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
        outputs.append({rid: r.outputs[0] for rid, r in results.items()})
        assert results["r3"].cached_tokens > 0
    assert engine.runner.backend is backend  # no fallback happened
    for rid, plain in outputs[0].items():
        assert outputs[1][rid].token_ids == plain.token_ids
        for got, want in zip(outputs[1][rid].logprobs or [], plain.logprobs or [], strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-9)
