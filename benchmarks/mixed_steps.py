"""The stall a prompt puts on the streams beside it, in the engine alone: online_serving.py's workload (streams of
128 prompt + 128 output tokens, 16 at a time, each replaced as it ends) run in process for each
``--max-mixed-step-ratio``, every step timed in the engine thread's CPU time, so that other processes on shared cores
do not move the figures (the server benchmark's wall-clock ITL does move with them).

    python benchmarks/mixed_steps.py [--ratios 1 1.25 1.5] [--requests 64]

A stream's inter-token latency is the time of the steps between its tokens: each decode in a step is one sample of
that step's time. The table gives their percentiles, the slowest steps, the time to the first token, and the CPU
seconds of the whole run (what the bound costs in throughput: a prompt spread over more steps leaves the running set
short of decodes longer). Model: online_serving.py's (``small``, float32, one torch thread).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from online_serving import model_dir

from batchgen.server.engine import EngineConfig, EngineRequest, SamplingParams
from batchgen.server.engine.factory import build_engine


def run(model: Path, ratio: float, args: argparse.Namespace) -> str:
    config = EngineConfig(
        model=str(model), max_num_seqs=args.concurrency, max_num_batched_tokens=args.max_num_batched_tokens,
        cpu_kv_cache_gib=1, enable_prefix_caching=False, max_mixed_step_ratio=ratio,
    )  # fmt: skip
    engine = build_engine(config)
    rng = random.Random(0)
    clock = 0.0
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}

    def add() -> None:
        request_id = f"r{len(arrived)}"
        arrived[request_id] = clock
        prompt = [rng.randrange(3, 32000) for _ in range(args.input_len)]
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        engine.add_request(EngineRequest(request_id, prompt, params, interactive=True, stream=True))

    for _ in range(args.concurrency):
        add()
    itls: list[float] = []
    steps: list[float] = []
    while engine.has_unfinished_requests():
        decodes = sum(seq.num_uncomputed == 1 for seq in engine.scheduler.running)
        start = time.thread_time()
        results = engine.step()
        seconds = time.thread_time() - start
        clock += seconds
        steps.append(seconds)
        itls += [seconds] * decodes
        for result in results:
            first.setdefault(result.request_id, clock)
            if result.finished and len(arrived) < args.requests:
                add()
    itls.sort()
    ttft = sorted(first[key] - arrived[key] for key in first)
    median_step = statistics.median(steps)
    cells = [
        f"{ratio:g}",
        *(f"{1e3 * itls[int(len(itls) * q)]:.1f}" for q in (0.5, 0.9, 0.99)),
        f"{1e3 * itls[-1]:.1f}",
        f"{itls[int(len(itls) * 0.99)] / itls[len(itls) // 2]:.2f}",
        f"{max(steps) / median_step:.1f}",
        *(f"{1e3 * ttft[int(len(ttft) * q)]:.0f}" for q in (0.5, 0.99)),
        f"{len(steps)}",
        f"{sum(steps):.1f}",
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", type=float, nargs="*", default=[1.0, 1.25, 1.5])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache = Path(os.environ.get("BATCHGEN_CACHE_DIR", Path(tempfile.gettempdir()) / "batchgen-bench"))
    model = model_dir(cache)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}; {args.requests} streams of "
        f"{args.input_len} + {args.output_len} tokens, {args.concurrency} at a time; engine-thread CPU ms\n"
    )
    print("| ratio | ITL p50 | ITL p90 | ITL p99 | ITL max | p99/p50 | slowest step / median | TTFT p50 | TTFT p99 "
          "| steps | CPU s |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ratio in args.ratios:
        print(run(model, ratio, args), flush=True)


if __name__ == "__main__":
    main()
