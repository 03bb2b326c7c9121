"""Resident memory of the engine process over rounds of the same kind of work: it must level off, not grow.

    python benchmarks/engine_memory.py                       # 6 rounds of 2,000 chat requests
    python benchmarks/engine_memory.py --rounds 10 --requests 5000

The demo model through ``EngineWorker`` (the server's path, in its own thread), default engine config (1 GiB KV
cache on CPU). Each round submits ``--requests`` tokenized chat prompts of varied lengths (about 40 to 800 tokens),
``max_tokens`` 2, and waits for every result. Each round's prompts differ from the previous rounds' (a round number
in every prompt), so the prefix cache keeps filling and recycling blocks, the worst case for its hash map; the
questions repeat across requests, so prompts still share prefixes. After each round the table shows VmRSS, the live
torch tensors and the prefix-cache entries. The KV cache is allocated (zeroed) before the first round, so growth in
the rounds is everything else: per-request state, per-step buffers, the allocator.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-server" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-schemas" / "src"))

from batchgen.server.engine import (
    EngineConfig,
    EngineRequest,
    EngineResult,
    EngineWorker,
    LLMEngine,
    SamplingParams,
    build_engine,
)

WORDS = [
    "the",
    "of",
    "batch",
    "engine",
    "cache",
    "token",
    "prompt",
    "model",
    "memory",
    "request",
]


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def live_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def chat_prompts(engine: LLMEngine, count: int, round_no: int, rng: random.Random) -> list[list[int]]:
    prompts = []
    for i in range(count):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))
        messages = [{"role": "system", "content": f"Round {round_no}."}, {"role": "user", "content": f"{question} {i}"}]
        text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(engine.tokenizer.encode(text, add_special_tokens=False))
    return prompts


def run_round(worker: EngineWorker, prompts: list[list[int]], round_no: int) -> float:
    done = threading.Event()
    remaining = [len(prompts)]

    def on_result(result: EngineResult) -> None:
        remaining[0] -= 1
        if result.error is not None:
            raise RuntimeError(result.error.message)
        if remaining[0] == 0:
            done.set()

    params = SamplingParams(max_tokens=2)
    requests = [EngineRequest(f"{round_no}-{i}", p, params) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    worker.submit(requests, on_result)
    while not done.wait(1.0):
        if not worker.healthy:
            raise RuntimeError(f"engine loop died: {worker.error!r}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=2000, help="requests per round")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: the cores are shared)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    start_rss = rss_mib()
    engine = build_engine(EngineConfig(model="demo", device="cpu"))
    worker = EngineWorker(engine)
    worker.start()
    rng = random.Random(0)
    cache_gib = engine.runner.num_blocks * engine.runner.block_bytes / 2**30
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, {args.threads} thread(s); "
        f"demo model; KV cache {engine.runner.num_blocks} blocks = {cache_gib:.2f} GiB; "
        f"{args.rounds} rounds x {args.requests} chat requests, max_tokens 2\n"
    )
    print("| after | requests | seconds | RSS MiB | change MiB | live tensors | prefix-cache entries |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| interpreter + torch | 0 | | {start_rss:.0f} | | | |")
    previous = rss_mib()
    built = f"| engine built (KV cache zeroed) | 0 | | {previous:.0f} | {previous - start_rss:+.0f} |"
    print(f"{built} {live_tensors()} | 0 |")
    for round_no in range(args.rounds):
        seconds = run_round(worker, chat_prompts(engine, args.requests, round_no, rng), round_no)
        tensors, now = live_tensors(), rss_mib()
        cells = [f"round {round_no + 1}", (round_no + 1) * args.requests, f"{seconds:.1f}", f"{now:.0f}"]
        cells += [f"{now - previous:+.0f}", tensors, len(engine.scheduler.block_manager.hash_to_block)]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)
        previous = now
    worker.stop(timeout=30)


if __name__ == "__main__":
    main()
