"""The engine on a GPU in one command: throughput, decode against the bandwidth roofline, time to first token.

    python benchmarks/gpu_suite.py                        # CUDA: the whole suite, within 8 minutes on an H200
    python benchmarks/gpu_suite.py --device cpu --quick   # the same tables on CPU, on small shapes (how it is checked)

Needs only torch and transformers (the engine imports nothing else): no download, no install. Models: random weights
in the shapes of Qwen2.5-0.5B and Llama-3.2-1B, built in code, bf16 on CUDA (``--quick``: the same architectures,
shrunk, float32 on CPU). For each model:

- **Throughput** on the nano-vllm workload (256 requests, prompts and outputs uniform in 100-1,024 tokens, random
  ids, ignore_eos): the engine (its second run, on other prompts of the same lengths: graphs are captured and layers
  compiled in the first), HF ``generate()`` on static batches (padded, each runs to its longest output) and
  transformers' ``generate_batch`` (continuous batching; stopped after ``--hf-time-limit-s``). Output tokens/s.
- **Decode** tokens/s at batch 1, 64 and 256 (512-token contexts): with CUDA graphs and async scheduling (the
  defaults), one step at a time (async scheduling off, same engine: what overlapping the host's work with the
  device's gives), with ``enforce_eager``, and as a fraction of the bandwidth roofline: each decode step reads every
  weight once (the embedding table only as the tied LM head) and every sequence's K/V, so tokens/s <= batch x
  bandwidth / bytes per step, with the bandwidth measured here (a device-to-device copy).
- **Time to first token** of one 1,024-token prompt on an idle engine, and HF ``generate(max_new_tokens=1)``.
- Last, **the host's work** a decode step, by part, with a tiny model on this device (``host_overhead.py``, about
  30 s on CPU; when a minute of the budget is left): with async scheduling, decode is bound by it wherever it is
  longer than the step's device time.

First, **exactness on this device**: the greedy tokens of 16 prompts through the engine with every fast path on
(compiled layers, the fast decode kernel, CUDA graphs), once per attention backend, against HF ``generate()``
one prompt at a time, in float32 with TF32 off, on the first shape shrunk as ``--quick`` shrinks it; and which fast
paths were still on at the end (each falls back to eager on a failure, which would show here as ``off``).

A measurement that could not end before ``--budget-s`` (default 7 minutes; each is started only if its usual
length is left) is skipped with a note, so the command ends in time. On a lent GPU machine, run it as
``timeout 560 python benchmarks/gpu_suite.py 2>&1 | tee $OUT/suite.md``: the tool's output keeps only the last
12,000 characters (``--profile`` alone prints about 9 KB a shape), and a file under ``$OUT`` keeps everything.
To find where a step's time goes: ``--kernels`` first times one layer's decode attention by implementation against
the bandwidth (``--kernels-only`` stops there: ``--device cpu --kernels-only`` compares the CPU kernels at the real
shapes), ``--profile`` prints ``torch.profiler``'s top device kernels and host calls of decode steps, and
``--skip "HF generate"`` leaves out what an earlier run measured (HF ``generate()`` takes about 2 minutes there).
Targets on an H200 (issue 14): >= 3x HF static ``generate()``, >= 60% of the roofline at batch 64 for the 1B shape,
graphs >= 2x eager at batch 1.
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import Clock, Row, make_workload, run_hf_generate, run_hf_generate_batch, sync

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from batchgen.server.engine.attention import DecodeBlocks, SeqSlice
from batchgen.server.engine.attention.decode import DecodeKernel, paged_decode
from batchgen.server.engine.attention.gather import GatherBackend, _Decodes
from batchgen.server.engine.attention.layer import LayerAttention
from batchgen.server.engine.loading.demo_model import build_tokenizer
from batchgen.server.engine.self_check import check_engine

SHAPES: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0,
    },
    "Llama-3.2-1B": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rope_theta": 500_000.0,
    },
}
QUICK = {"head_dim": 16, "intermediate_size": 1024, "num_hidden_layers": 4, "vocab_size": 32000}
"""``--quick``: each shape shrunk to heads of 16 and 4 layers (head counts and the architecture kept), 10-25M
parameters: above the size under which the engine runs eagerly, so the compiled path runs."""


@dataclass
class Settings:
    requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    decode_batches: tuple[int, ...]
    decode_context: int
    decode_steps: int
    ttft_prompt: int


FULL = Settings(256, (100, 1024), (100, 1024), (1, 64, 256), 512, 64, 1024)
SMALL = Settings(16, (16, 64), (16, 64), (1, 4, 16), 64, 16, 64)


EXACT_TOKENS = 32


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self, seconds: float = 0.0) -> bool:
        """Whether ``seconds`` are left before the deadline."""
        return time.monotonic() + seconds < self.deadline

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


def build(shape: str, quick: bool, device: str, dtype: torch.dtype) -> Any:
    sizes = {**SHAPES[shape], **(QUICK if quick else {})}
    if quick:
        sizes["hidden_size"] = sizes["num_attention_heads"] * sizes["head_dim"]
    config = AutoConfig.for_model(**sizes, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None  # every request runs to its length (ignore_eos)
    model.generation_config.pad_token_id = 0
    return model.eval()


def bandwidth(device: str) -> float:
    """Bytes per second a device-to-device copy moves (read plus write), best of 5."""
    size = 2**30 if device.startswith("cuda") else 2**28
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        target.copy_(source)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size / best


def engine_config(args: argparse.Namespace, eager: bool) -> EngineConfig:
    """On CUDA the cache takes half the free memory (the HF rows need room too); on CPU 0.25 GiB with ``--quick``."""
    return EngineConfig(
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=4096,
        enforce_eager=eager,
        gpu_memory_utilization=0.5,
        attention_backend=args.attention_backend,
        cpu_kv_cache_gib=0.25 if args.quick else 4.0,
    )


def serve(engine: LLMEngine, workload: list[tuple[list[int], int]], tag: str) -> tuple[int, float]:
    """Output tokens and wall seconds to finish ``workload``."""
    for i, (prompt, length) in enumerate(workload):
        engine.add_request(EngineRequest(f"{tag}{i}", prompt, SamplingParams(max_tokens=length, ignore_eos=True)))
    device = str(engine.runner.device)
    sync(device)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(result.completion_tokens for result in engine.step())
    sync(device)
    return tokens, time.perf_counter() - start


def decode_rate(engine: LLMEngine, batch: int, context: int, steps: int, vocab: int) -> float:
    """Tokens/s of steps where ``batch`` sequences of ``context`` tokens each decode one token."""
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(context)]
        params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
        engine.add_request(EngineRequest(f"d{i}", prompt, params))
    scheduler = engine.scheduler
    while scheduler.waiting or any(seq.num_uncomputed > 1 for seq in scheduler.running):
        engine.step()  # prefills, then the first tokens
    for _ in range(2):
        engine.step()  # the first decode steps of this shape (a graph capture)
    device = str(engine.runner.device)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    rate = batch * steps / (time.perf_counter() - start)
    for i in range(batch):
        engine.abort_request(f"d{i}")
    return rate


def step_bytes(engine: LLMEngine, batch: int, context: int) -> int:
    """What one decode step must read: every weight (the input embeddings only if they are not the tied LM head,
    and then only ``batch`` rows), and every sequence's K/V."""
    model = engine.runner.model
    embeddings = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.get_output_embeddings().weight is not embeddings:
        weights -= embeddings.numel() * embeddings.element_size()
    kv = engine.runner.block_bytes // engine.config.block_size * batch * context
    return weights + kv


def time_to_first_token(engine: LLMEngine, prompt_len: int, vocab: int) -> float:
    """Median seconds from adding one request to its first token, on an idle engine (5 new prompts)."""
    times = []
    for trial in range(5):
        rng = random.Random(100 + trial)
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(EngineRequest(f"t{trial}", prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_time_to_first_token(model: Any, prompt_len: int, vocab: int, device: str) -> float:
    model.set_attn_implementation("sdpa")
    times = []
    for trial in range(5):
        rng = random.Random(100 + trial)
        ids = torch.tensor([[rng.randrange(3, vocab) for _ in range(prompt_len)]], device=device)
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def release(device: str) -> None:
    """Give back what a released engine held (its KV cache, its graphs' memory)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def kernels(shape: str, args: argparse.Namespace) -> list[str]:
    """One layer's decode attention, by implementation, at the decode batches: time and the share of the bandwidth
    that reading every visible key and value once would take."""
    device, dtype = args.device, getattr(torch, args.dtype)
    sizes = {**SHAPES[shape], **(QUICK if args.quick else {})}
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    dim = sizes.get("head_dim") or sizes["hidden_size"] // heads
    settings = SMALL if args.quick else FULL
    bs, context = 16, settings.decode_context
    layer = LayerAttention(None, None, None, None)
    compiled = DecodeKernel()
    inductor = torch.compile(paged_decode, dynamic=False)  # the CPU path before the C++ kernel, compiled per batch
    variants: dict[str, Callable[..., torch.Tensor]] = {
        "DecodeKernel (the engine's)": lambda q, k, v, views: compiled(q, k, v, views.blocks, layer),
        "paged_decode, compiled (inductor)": lambda q, k, v, views: inductor(
            q, k, v, views.blocks, None, dim**-0.5, None
        ),
        "paged_decode, eager": lambda q, k, v, views: paged_decode(q, k, v, views.blocks, None, dim**-0.5, None),
        "gather + SDPA (eager fallback)": lambda q, k, v, views: GatherBackend(None)._decode(q, k, v, views, bs, layer),
    }
    bw = bandwidth(device)
    lines = [
        "",
        f"### Decode attention, one layer of {shape} ({heads} heads, {kv_heads} KV heads, dim {dim}, {args.dtype}), "
        f"{context}-token contexts",
        "",
        "| batch | implementation | us | of bandwidth |",
        "|---:|---|---:|---:|",
    ]
    for batch in settings.decode_batches:
        num_blocks = batch * (context // bs + 1)
        k = torch.randn(kv_heads, num_blocks * bs, dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        order = torch.randperm(num_blocks).view(batch, -1).numpy()  # each sequence's block table, a row
        seqs = [SeqSlice(i, 1, context, i) for i in range(batch)]
        blocks = DecodeBlocks.build(seqs, None, bs, order).to(torch.device(device))
        views = _Decodes(None, blocks, blocks.visible())
        q = torch.randn(batch, heads, dim, device=device, dtype=dtype)
        read = 2 * batch * (context + 1) * kv_heads * dim * k.element_size()
        for name, fn in variants.items():
            try:
                seconds = _median_time(lambda fn=fn, args=(q, k, v, views): fn(*args), device)
                lines.append(f"| {batch} | {name} | {seconds * 1e6:,.0f} | {read / seconds / bw:.0%} |")
            except Exception as exc:
                lines.append(f"| {batch} | {name} | failed: {type(exc).__name__}: {str(exc)[:200]} | |")
        del k, v
        release(device)
    if compiled.path.off is not None:
        lines.append(f"\nThe engine's kernel failed and its rows ran `paged_decode` eagerly: {compiled.path.off}")
    return lines


def _median_time(fn: Callable[[], object], device: str, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_decode(engine: LLMEngine, settings: Settings, vocab: int) -> list[str]:
    """Where a decode step's time goes at the middle decode batch: the top device kernels and host calls."""
    batch = settings.decode_batches[len(settings.decode_batches) // 2]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.runner.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        decode_rate(engine, batch, settings.decode_context, 8, vocab)
    averages = prof.key_averages()
    lines = ["", f"### Profile: decode at batch {batch} (prefill included)", "", "```"]
    if engine.runner.device.type == "cuda":
        lines.append(averages.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))
    lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    return [*lines, "```"]


def exactness(shape: str, args: argparse.Namespace) -> list[str]:
    """The engine's greedy tokens against HF ``generate()``'s, per attention backend, as markdown lines."""
    device = args.device
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = build(shape, True, device, torch.float32)
    vocab = model.config.vocab_size
    rng = random.Random(7)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 80))] for _ in range(16)]
    model.set_attn_implementation("sdpa")
    reference = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=EXACT_TOKENS, do_sample=False)
        reference.append(out[0, len(prompt) :].tolist())
    lines = [
        "",
        f"### Exactness on this device: {shape} shrunk, float32, 16 prompts x {EXACT_TOKENS} greedy tokens vs HF",
        "",
        "| attention | identical sequences | identical tokens | fast paths still on | seconds |",
        "|---|---:|---:|---|---:|",
    ]
    for backend in ("gather", "flex"):
        clock = Clock()
        try:
            config = EngineConfig(
                device=device,
                dtype="float32",
                attention_backend=backend,
                max_num_seqs=16,
                max_num_batched_tokens=256,
                num_kv_blocks=1024,
            )
            engine = LLMEngine(model, build_tokenizer(), config, shape)
            check_engine(engine)  # as build_engine does
            params = SamplingParams(max_tokens=EXACT_TOKENS, ignore_eos=True)
            for i, prompt in enumerate(prompts):
                engine.add_request(EngineRequest(f"x{i}", prompt, params))
            results = {}
            while engine.has_unfinished_requests():
                results.update((result.request_id, result) for result in engine.step())
            outputs = [results[f"x{i}"].outputs[0].token_ids for i in range(len(prompts))]
            same = sum(out == ref for out, ref in zip(outputs, reference, strict=True))
            tokens = sum(
                a == b for out, ref in zip(outputs, reference, strict=True) for a, b in zip(out, ref, strict=False)
            )
            cells = [f"{same}/{len(prompts)}", f"{tokens}/{len(prompts) * EXACT_TOKENS}", _fast_paths(engine)]
        except Exception as exc:  # a backend that cannot run here is a finding, not the end of the suite
            cells = ["", "", f"failed: {type(exc).__name__}: {str(exc)[:300]}"]
        lines.append(f"| {backend} | " + " | ".join(cells) + f" | {clock.elapsed()[0]:.0f} |")
        release(device)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return lines


def _fast_paths(engine: LLMEngine) -> str:
    runner = engine.runner
    kernel = getattr(runner.backend, "decode_kernel", None)
    graph_kernel = runner.graphs.kernel if runner.graphs is not None else None  # the graphs capture their own
    states = {
        "layers": runner.fast is not None,
        "compiled attention": runner.backend is not runner.eager_backend
        and not (kernel and kernel.path.off)
        and not (graph_kernel and graph_kernel.path.off),
    }
    if runner.device.type == "cuda":
        states["CUDA graphs"] = runner.graphs is not None and runner.graphs.captured > 0
    return ", ".join(f"{name} {'on' if on else 'off'}" for name, on in states.items())


def _prefill_path(engine: LLMEngine) -> str:
    varlen = getattr(engine.runner.backend, "varlen", None)
    if varlen is None:
        return "one SDPA call each (no varlen call on this device or backend)"
    if varlen.path.off is not None:
        return f"one SDPA call each (the varlen call failed: {varlen.path.off})"
    checked = ", ".join(
        f"window {window}: {'continuing' if continues else 'new'}{' past the window' if beyond else ''}"
        for window, continues, beyond in sorted(varlen.checked, key=str)
    )
    return f"one varlen call a step (checked against per-chunk SDPA on first use of: {checked or 'none yet'})"


def suite(shape: str, args: argparse.Namespace, settings: Settings, budget: Budget, bw: float) -> list[str]:
    """Every measurement of one model shape, as markdown lines."""
    device = args.device
    model = build(shape, args.quick, device, getattr(torch, args.dtype))
    vocab = model.config.vocab_size
    tokenizer = build_tokenizer()
    lines = [f"## {shape} shape ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {args.dtype})"]
    workload = make_workload(settings.requests, settings.prompt_len, settings.output_len, seed=1, vocab=vocab)
    warm = make_workload(settings.requests, settings.prompt_len, settings.output_len, seed=2, vocab=vocab)
    rows: list[Row] = []
    decode: dict[tuple[int, str], float] = {}
    ttft: dict[str, float] = {}
    bytes_per_step: dict[int, int] = {}
    skipped: list[str] = []

    def measure(name: str, fn: Callable[[], object], seconds: float = 0.0) -> None:
        """Run ``fn`` if it can end (about ``seconds``) before the budget's deadline."""
        if any(name.startswith(prefix) for prefix in args.skip):
            return
        if budget.left(seconds):
            fn()
        else:
            skipped.append(name)

    def decode_at(engine: LLMEngine, batch: int, mode: str) -> None:
        decode[(batch, mode)] = decode_rate(engine, batch, settings.decode_context, settings.decode_steps, vocab)

    def decode_one_step_at_a_time(engine: LLMEngine, batch: int) -> None:
        engine.async_scheduling = False
        try:
            decode_at(engine, batch, "sync")
        finally:
            engine.async_scheduling = engine.config.uses_async_scheduling(engine.runner.device)

    def engine_measurements() -> None:
        if not budget.left(60):  # building it (self-check, compiling, first captures) alone takes 30-60 s
            skipped.append("the engine's measurements")
            return
        clock = Clock()
        engine = LLMEngine(model, tokenizer, engine_config(args, eager=False), shape)
        check_engine(engine)  # as build_engine does: its steps compile the layers

        def throughput() -> None:
            serve(engine, warm, "w")  # compiles the layers and captures the graphs this workload needs
            tokens, seconds = serve(engine, workload, "r")
            rows.append(
                Row("batchgen engine", tokens, seconds, seconds, "second run (compiled, captured in the first)")
            )

        measure("engine throughput", throughput, 100)
        lines.append(f"prefill chunks: {_prefill_path(engine)}")
        for batch in settings.decode_batches:
            measure(f"decode at batch {batch}", lambda batch=batch: decode_at(engine, batch, "default"))
        measure("engine TTFT", lambda: ttft.update(engine=time_to_first_token(engine, settings.ttft_prompt, vocab)))
        if args.profile:
            measure("profile", lambda: lines.extend(profile_decode(engine, settings, vocab)))
        if engine.async_scheduling:
            for batch in settings.decode_batches:
                measure(f"sync decode at batch {batch}", lambda batch=batch: decode_one_step_at_a_time(engine, batch))
        bytes_per_step.update({b: step_bytes(engine, b, settings.decode_context) for b in settings.decode_batches})
        lines.append(f"engine built, compiled, warmed up and measured in {clock.elapsed()[0]:.0f} s")

    def eager_measurements() -> None:
        batch = settings.decode_batches[0]
        if not budget.left(20):
            skipped.append(f"enforce_eager decode at batch {batch}")
            return
        # The first engine compiled the model's layers in place: eager means the stance, too.
        with torch.compiler.set_stance("force_eager"):
            engine = LLMEngine(model, tokenizer, engine_config(args, eager=True), shape)
            check_engine(engine)
            measure(f"enforce_eager decode at batch {batch}", lambda: decode_at(engine, batch, "eager"))

    for measurements in (engine_measurements, eager_measurements):
        measurements()
        release(device)  # the engine and its KV cache go with the function's frame
    with torch.compiler.set_stance("force_eager"):  # the engine compiled the model's layers in place
        measure("HF generate", lambda: rows.append(run_hf_generate(model, workload, device, args.hf_batch)), 130)
        limit, budget_tokens = args.hf_time_limit_s, args.max_num_batched_tokens
        measure(
            "HF generate_batch",
            lambda: rows.append(run_hf_generate_batch(model, workload, device, budget_tokens, limit)),
            limit,
        )
        measure("HF TTFT", lambda: ttft.update(hf=hf_time_to_first_token(model, settings.ttft_prompt, vocab, device)))
    lines += _throughput_table(rows, settings) + _decode_table(decode, bytes_per_step, bw, settings)
    lines += _ttft_table(ttft, settings)
    if skipped:
        lines += ["", f"Skipped (past the {args.budget_s:.0f} s budget): {', '.join(skipped)}"]
    return lines


def _throughput_table(rows: list[Row], settings: Settings) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        f"### Throughput: {settings.requests} requests, prompts {settings.prompt_len[0]}-{settings.prompt_len[1]}, "
        f"outputs {settings.output_len[0]}-{settings.output_len[1]} tokens",
        "",
        "| system | output tokens | seconds | tokens/s | engine / system | note |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        ratio = rows[0].tokens_per_second(False) / row.tokens_per_second(False)
        lines.append(
            f"| {row.name} | {row.output_tokens} | {row.seconds:.1f} | {row.tokens_per_second(False):,.0f} "
            f"| {ratio:.2f}x | {row.note} |"
        )
    return lines


def _decode_table(
    decode: dict[tuple[int, str], float], bytes_per_step: dict[int, int], bw: float, settings: Settings
) -> list[str]:
    if not decode:
        return []
    lines = [
        "",
        f"### Decode: {settings.decode_context}-token contexts; bandwidth {bw / 1e9:,.0f} GB/s (a measured copy)",
        "",
        "| batch | tokens/s | one step at a time | default / that | enforce_eager tokens/s | default / eager "
        "| roofline tokens/s | of roofline |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch in settings.decode_batches:
        rate, sync_rate, eager_rate = (decode.get((batch, mode)) for mode in ("default", "sync", "eager"))
        roofline = batch * bw / bytes_per_step[batch] if batch in bytes_per_step else None
        cells = [str(batch), _num(rate), _num(sync_rate), f"{rate / sync_rate:.2f}x" if rate and sync_rate else ""]
        cells += [_num(eager_rate), f"{rate / eager_rate:.2f}x" if rate and eager_rate else ""]
        cells += [_num(roofline), f"{rate / roofline:.0%}" if rate and roofline else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _ttft_table(ttft: dict[str, float], settings: Settings) -> list[str]:
    if not ttft:
        return []
    return [
        "",
        f"### Time to first token: one {settings.ttft_prompt}-token prompt on an idle engine (median of 5)",
        "",
        "| engine ms | HF generate ms |",
        "|---:|---:|",
        f"| {_ms(ttft.get('engine'))} | {_ms(ttft.get('hf'))} |",
    ]


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}"


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value * 1000:,.1f}"


def host_work(args: argparse.Namespace, seconds: float) -> list[str]:
    """The host's work a decode step by part, the model on this device (``host_overhead.py``, in its own process:
    it wraps the engine's classes with timers for good), stopped after ``seconds``: what async scheduling must hide
    behind the device's."""
    script = Path(__file__).with_name("host_overhead.py")
    options = ["--batches", "4", "16", "--rounds", "1", "--steps", "10"] if args.quick else ["--rounds", "3"]
    command = [sys.executable, str(script), "--device", args.device, *options]
    title = f"### The host's work a decode step, us a sequence (the model on {args.device}, `host_overhead.py`)"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired as stopped:  # its stdout comes as bytes, text=True or not
        title, measured = f"{title}: stopped after {seconds:.0f} s (the budget)", (stopped.stdout or b"").decode()
    else:
        if done.returncode != 0:
            return ["", f"{title}: failed", "", "```", done.stderr[-2000:], "```"]
        measured = done.stdout
    return ["", title, "", *(line for line in measured.splitlines() if line.startswith("|"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--quick", action="store_true", help="small shapes and workloads (for CPU)")
    parser.add_argument("--models", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--hf-batch", type=int, default=256, help="HF generate()'s static batch size")
    parser.add_argument("--hf-time-limit-s", type=float, default=30.0, help="generate_batch stops after this")
    parser.add_argument("--budget-s", type=float, default=420.0, help="later measurements are skipped")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--attention-backend", default="auto", help="the engine's, for the measurements")
    parser.add_argument("--no-exactness", action="store_true", help="skip the exactness check")
    parser.add_argument("--skip", nargs="*", default=[], help="measurements to skip, by the start of their name")
    parser.add_argument("--kernels", action="store_true", help="time decode attention kernels alone first")
    parser.add_argument("--kernels-only", action="store_true", help="time decode attention kernels, and stop")
    parser.add_argument("--profile", action="store_true", help="profile decode steps (torch.profiler)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)  # a fast path falling back says so
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    budget = Budget(args.budget_s)
    settings = SMALL if args.quick else FULL
    if args.quick:
        args.hf_batch = min(args.hf_batch, settings.requests)
    cuda = args.device.startswith("cuda")
    machine = torch.cuda.get_device_name(args.device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    bw = bandwidth(args.device)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# batchgen GPU suite: {machine}; torch {torch.__version__}; {when}", flush=True)
    if args.kernels or args.kernels_only:
        for shape in args.models:
            print("\n".join(kernels(shape, args)), flush=True)
    if args.kernels_only:
        return
    if not args.no_exactness:
        print("\n".join(exactness(args.models[0], args)), flush=True)
    for shape in args.models:
        try:
            print("\n".join(["", *suite(shape, args, settings, budget, bw)]), flush=True)
        except Exception:  # one shape's failure is a finding; the next shape still runs
            print(f"\n## {shape} shape: failed\n\n```\n{traceback.format_exc()}```", flush=True)
            release(args.device)
    if any("host's work".startswith(prefix) for prefix in args.skip):
        return
    if budget.left(60):
        print("\n".join(host_work(args, budget.remaining() + 20)), flush=True)
    else:
        print(f"\nSkipped (past the {args.budget_s:.0f} s budget): the host's work a decode step", flush=True)


if __name__ == "__main__":
    main()
