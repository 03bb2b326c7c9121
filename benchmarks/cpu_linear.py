"""The packed linear (``engine/ops/cpu_linear.cpp``) against MKL and oneDNN on CPU, alone and in the engine.

    python benchmarks/cpu_linear.py                 # the GEMMs alone, then the engine (about 5 minutes)
    python benchmarks/cpu_linear.py --gemm-only

The GEMMs alone: ``y = x W^T`` at a decode step's row counts, float32, one thread, each weight out of the caches as it
is in a step (enough copies to fill more than the last-level cache, used in turn), on the shapes of the throughput
benchmark's model and of Qwen2.5-0.5B. GFLOP/s of torch's linear (MKL), oneDNN on a weight reordered once (how vLLM's
CPU build runs its linears) and batchgen's ``cpu_linear.linear``: the packed-panel kernel for the row counts it takes,
MKL for the others (marked).

The engine: ``engine_throughput.py``'s model and ``--quick`` workload, one engine whose steps alternate between its
packed linears and torch's own (the kernel's row range emptied), the parity swapped every round, so that both sides
see the same steps and the same moments of a shared machine: CPU seconds of each side's steps, and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-server" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-schemas" / "src"))

import engine_throughput

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from batchgen.server.engine.loading.demo_model import build_tokenizer
from batchgen.server.engine.ops import cpu_linear
from batchgen.server.engine.self_check import check_engine

SHAPES = {
    "benchmark model q/k/v/o (384 -> 384)": (384, 384),
    "benchmark model gate/up (384 -> 1,024)": (1024, 384),
    "benchmark model down (1,024 -> 384)": (384, 1024),
    "benchmark model head (384 -> 32,000)": (32000, 384),
    "Qwen2.5-0.5B gate/up (896 -> 4,864)": (4864, 896),
    "Qwen2.5-0.5B down (4,864 -> 896)": (896, 4864),
}
ROWS = (1, 4, 16, 32, 64, 128, 256)
OUT_OF_CACHE_BYTES = 200e6


def gemms() -> list[str]:
    lines = [
        "| weight | rows | MKL GFLOP/s | oneDNN prepacked | batchgen | batchgen / MKL | batchgen / oneDNN |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (out_features, in_features) in SHAPES.items():
        copies = max(2, int(OUT_OF_CACHE_BYTES // (out_features * in_features * 4)))
        weights = [torch.randn(out_features, in_features) / in_features**0.5 for _ in range(copies)]
        panels = [cpu_linear.pack(w) for w in weights]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            expected = x @ weights[0].T
            torch.testing.assert_close(
                cpu_linear.linear(x, weights[0], panels[0], None), expected, rtol=1e-4, atol=1e-4
            )
            flops = 2 * rows * out_features * in_features
            mkl = _gflops(torch.nn.functional.linear, [(x, w) for w in weights], flops)
            dnn = _gflops(torch.ops.mkldnn._linear_pointwise, [(x, w, None, "none", [], "") for w in onednn], flops)
            ours = _gflops(cpu_linear.linear, [(x, w, p, None) for w, p in zip(weights, panels, strict=True)], flops)
            ours_cell = f"{ours:.1f}" if rows in cpu_linear.ROWS else f"{ours:.1f} (MKL)"
            ratios = f"{ours / mkl:.2f}x | {ours / dnn:.2f}x"
            lines.append(f"| {name} | {rows} | {mkl:.1f} | {dnn:.1f} | {ours_cell} | {ratios} |")
            print(lines[-1], flush=True)
    return lines


def _gflops(fn: Callable[..., object], calls: list[tuple[object, ...]], flops: int) -> float:
    """GFLOP/s of ``fn`` over ``calls`` in turn (each with its own weight), about 3 GFLOP in all."""
    repeats = min(400, max(len(calls), int(3e9 / flops)))
    fn(*calls[0])
    start = time.perf_counter()
    for i in range(repeats):
        fn(*calls[i % len(calls)])
    return flops * repeats / (time.perf_counter() - start) / 1e9


def engine(rounds: int) -> list[str]:
    model = engine_throughput.make_model("small", "cpu", torch.float32)
    workload = engine_throughput.make_workload(64, (16, 256), (16, 128), 0)
    config = EngineConfig(device="cpu", dtype="float32", max_num_batched_tokens=1024, max_num_seqs=256)
    llm = LLMEngine(model, build_tokenizer(), config, "bench")
    check_engine(llm)  # as build_engine does: its steps compile the layers before the rounds
    kernel_rows = cpu_linear.ROWS
    seconds = {True: 0.0, False: 0.0}
    lines = ["| round | packed linears, CPU s | torch's linears, CPU s | torch's / packed |", "|---:|---:|---:|---:|"]
    for r in range(-1, rounds):  # round -1 warms both sides up
        llm.reset()
        for i, (prompt, out_len) in enumerate(workload):
            llm.add_request(EngineRequest(f"{r}-{i}", prompt, SamplingParams(max_tokens=out_len, ignore_eos=True)))
        spent = {True: 0.0, False: 0.0}
        step = 0
        while llm.has_unfinished_requests():
            packed = step % 2 == r % 2
            cpu_linear.ROWS = kernel_rows if packed else range(0)
            start = time.process_time()
            llm.step()
            spent[packed] += time.process_time() - start
            step += 1
        cpu_linear.ROWS = kernel_rows
        if r >= 0:
            seconds = {side: seconds[side] + spent[side] for side in spent}
            lines.append(f"| {r} | {spent[True]:.2f} | {spent[False]:.2f} | {spent[False] / spent[True]:.3f}x |")
            print(lines[-1], flush=True)
    lines.append(f"| all | {seconds[True]:.2f} | {seconds[False]:.2f} | **{seconds[False] / seconds[True]:.3f}x** |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gemm-only", action="store_true")
    parser.add_argument("--rounds", type=int, default=6, help="engine rounds (an even number: each parity as often)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    tables = [gemms()]
    if not args.gemm_only:
        tables.append(engine(args.rounds))
    print()
    for table in tables:
        print("\n".join(table), end="\n\n")


if __name__ == "__main__":
    main()
