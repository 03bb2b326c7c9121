"""The host's work a decode step, per sequence, by part: what bounds a GPU's decode at large batches.

    python benchmarks/host_overhead.py                 # batches 64 and 256, 512-token contexts, on CPU
    python benchmarks/host_overhead.py --batches 256 --rounds 9
    python benchmarks/host_overhead.py --device cuda   # the model on the GPU: the host's work as a GPU step has it

On a GPU the host schedules, packs inputs, builds the attention's metadata, prepares sampling and reads results for
every step; with async scheduling that work hides behind the device's only while it is shorter (an H200 reads the
1B shape's decode step at batch 64 in about 0.85 ms: ``benchmarks/RESULTS.md``). This measures it on CPU, on a
model whose forward is cheap (two narrow layers, compiled as the engine compiles a real one, the 32,000-token head):
each part is timed around its own call, and the host's work is the step's time less what would run on the device
(the model's forward, without the attention metadata it builds on the host first, and the sampler's argmax). Parts:
``schedule`` (the scheduler), ``prepare`` (the step's inputs in one walk: token ids, positions, slots, the sampled
rows), ``decode tables`` (the decode kernel's input, ``DecodeBlocks.build``), ``sampler`` (its host side),
``settle`` (reading tokens back, stop checks, bookkeeping), ``rest of the step`` (the batch state following the
scheduler, advancing the sequences).

On CPU this is an estimate of a GPU host's work, off both ways: the host's work inside the forward (the layers'
entry, the attention operator's Python) counts as the device's, and a GPU's decode steps also refill their CUDA
graphs' inputs; but the CPU forward evicts the host's caches between steps, which makes each numpy and torch call
several times dearer than on a host whose forward runs elsewhere (the decode kernel's metadata at batch 1: 40 us hot,
330 after reading 64 MB, measured when it was built as pairs). With ``--device cuda`` the model runs on the GPU as
the engine runs it there (bfloat16, compiled, CUDA graphs, async scheduling), and the measurement is direct: the
host's work is the step's time less its one wait for the device (reading a step's tokens back, timed apart), and
``rest of the step`` includes launching the forward (the CUDA graph's refill and replay).

Each round times ``--steps`` steps of ``batch`` decodes; the table gives the median of ``--rounds`` rounds in
microseconds a sequence a step. Absolute figures move with the machine (2x between days here): compare versions in
alternating runs.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-server" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-schemas" / "src"))

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from batchgen.server.engine.attention import DecodeBlocks
from batchgen.server.engine.core import engine as engine_module
from batchgen.server.engine.core.scheduler import Scheduler
from batchgen.server.engine.loading.demo_model import build_model, build_tokenizer
from batchgen.server.engine.ops import transfer
from batchgen.server.engine.runner import model_runner
from batchgen.server.engine.runner.inputs import InputBuffers
from batchgen.server.engine.sampling import sampler
from batchgen.server.engine.self_check import check_engine

PARTS = ["schedule", "prepare", "decode tables", "sampler", "settle", "rest of the step"]


class Timers:
    """Seconds spent in each wrapped callable, summed; ``wrap`` replaces the callable on its owner for good."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()

    def wrap(self, owner: Any, name: str, key: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - start

        setattr(owner, name, timed)


def instrument() -> Timers:
    timers = Timers()
    timers.wrap(Scheduler, "schedule", "schedule")
    timers.wrap(InputBuffers, "prepare", "prepare")
    timers.wrap(DecodeBlocks, "build", "decode tables")
    timers.wrap(sampler.Sampler, "launch", "sampler")
    timers.wrap(sampler, "argmax_first", "argmax")
    timers.wrap(engine_module.LLMEngine, "_settle", "settle")
    timers.wrap(transfer.HostCopy, "tolist", "wait")
    timers.wrap(model_runner.ModelRunner, "forward", "forward")
    timers.wrap(engine_module.LLMEngine, "step", "step")
    return timers


def make_engine(batch: int, context: int, max_tokens: int, device: torch.device) -> LLMEngine:
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}
    model = build_model(32000, 1, 2, 0, **sizes, num_key_value_heads=2, max_position_embeddings=4096).eval()
    if device.type == "cuda":
        model = model.to(device, torch.bfloat16)
    model.generation_config.eos_token_id = None
    model_runner.EAGER_BELOW_PARAMETERS = 0  # compiled, as a real model is
    blocks = batch * ((context + max_tokens) // 16 + 2)  # never preempts
    config = EngineConfig(max_num_batched_tokens=8192, max_num_seqs=batch, num_kv_blocks=blocks)
    engine = LLMEngine(model, build_tokenizer(), config, "bench")
    check_engine(engine)  # as build_engine does
    return engine


def measure(
    batch: int, context: int, steps: int, rounds: int, timers: Timers, device: torch.device
) -> dict[str, float]:
    """Median microseconds a sequence a step of each part (and of the host's work, ``host``)."""
    max_tokens = steps * rounds + batch * context // 8192 + 8
    engine = make_engine(batch, context, max_tokens, device)
    rng = random.Random(0)

    def add(tag: str, max_tokens: int) -> None:
        for i in range(batch):
            prompt = [rng.randrange(3, 32000) for _ in range(context)]
            engine.add_request(
                EngineRequest(f"{tag}{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            )

    add("warm", 3)  # compiles the layers, at both shapes
    while engine.has_unfinished_requests():
        engine.step()
    add("run", max_tokens)
    for _ in range(batch * context // 8192 + 3):  # the prompts
        engine.step()
    per_round: list[dict[str, float]] = []
    for _ in range(rounds):
        timers.seconds.clear()
        for _ in range(steps):
            engine.step()
        us = collections.defaultdict(float, {key: value / steps / batch * 1e6 for key, value in timers.seconds.items()})
        if device.type == "cuda":  # the device runs apart: the host waits for it in one place
            us["settle"] -= us["wait"]
            us["host"] = us["step"] - us["wait"]
        else:  # the device is this CPU: take out what would run on a GPU
            us["sampler"] -= us["argmax"]
            us["host"] = us["step"] - (us["forward"] - us["decode tables"] + us["argmax"])
        us["rest of the step"] = us["host"] - sum(us[part] for part in PARTS[:-1])
        per_round.append(us)
    return {key: statistics.median(us[key] for us in per_round) for key in [*PARTS, "host", "step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40, help="steps a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    timers = instrument()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{when}; torch {torch.__version__}; the model on {device}; {args.threads} thread(s)")
    print(f"us a sequence a decode step, {args.context}-token contexts, median of {args.rounds} x {args.steps} steps\n")
    print(f"| batch | host's work | {' | '.join(PARTS)} | whole step |")
    print(f"|---:|---:|{'---:|' * len(PARTS)}---:|")
    for batch in args.batches:
        us = measure(batch, args.context, args.steps, args.rounds, timers, device)
        parts = " | ".join(f"{us[part]:.1f}" for part in PARTS)
        host = f"**{us['host']:.1f}** ({us['host'] * batch / 1e3:.2f} ms a step)"
        print(f"| {batch} | {host} | {parts} | {us['step']:.1f} |", flush=True)  # a row survives a timeout


if __name__ == "__main__":
    main()
