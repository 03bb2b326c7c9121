"""Throughput of engine replicas on Ray: 1 against 2 CPU replicas of the demo model, on the same workload, in one run.

    python benchmarks/replicas.py                   # 256 requests x 64 tokens, best of 5 rounds
    python benchmarks/replicas.py --requests 128 --rounds 1 --no-results

Every row runs the same input file through ``run-batch``'s path (the batch loop with plain files) and times it from
the moment the engine is ready until the last result is written (model loading, Ray's start and its shutdown are
not counted). Rows, interleaved round by round so that the load of a shared machine falls on all of them alike:

- ``in-process engine``: no Ray, one engine in this process with one torch thread (the default path);
- ``in-process engine, N threads``: the other way to use the cores: one engine, one torch thread per core;
- ``1 replica`` / ``2 replicas``: ``--replicas 1`` / ``--replicas 2``, each replica a process with one torch thread,
  on a private local Ray started for the row (as ``serve --replicas N`` does without ``--ray-address``).

The table gives each row's best round (and median), its speed-up over 1 replica and, for 2 replicas, how close that
comes to linear (speed-up / 2), with the machine's core count and load average. On cores shared with other jobs the
wall clock only shows what the machine had to give, so the CPU seconds are measured too (Linux: ``/proc``): of the
engines (this process for the in-process rows, the replicas' processes otherwise) and of the server side (this
process: the batch loop, tokenizing, writing results) for the replica rows. Appends a "Replicas" section to
benchmarks/RESULTS.md unless ``--no-results``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import string
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from api_latency import append_section

from batchgen.server.engine.config import EngineConfig
from batchgen.server.engines import load_engine
from batchgen.server.replicas.config import ClusterConfig
from batchgen.server.replicas.pool import ReplicaPool
from batchgen.server.run_batch import run_batch


@dataclass
class Row:
    name: str
    replicas: int
    threads: int
    seconds: list[float] = field(default_factory=list)
    engine_cpu: list[float] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)
    shares: list[int] = field(default_factory=list)
    """Results each replica returned in the last round."""

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def best_round(self) -> int:
        return self.seconds.index(self.best)


class ReplicaCpu(threading.Thread):
    """The CPU seconds the pool's replica processes spend from the first reading on (after loading the model: the
    pool answers once they run), read from /proc while they live (they end with the run)."""

    def __init__(self, pool: ReplicaPool) -> None:
        super().__init__(daemon=True)
        self.pool, self.done = pool, threading.Event()
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def run(self) -> None:
        ticks = os.sysconf("SC_CLK_TCK")
        while not self.done.wait(0.05):
            for replica in self.pool.replicas():
                try:
                    fields = Path(f"/proc/{replica.pid}/stat").read_text().rsplit(")", 1)[1].split()
                except (OSError, IndexError):
                    continue
                self.last[replica.pid] = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
                self.first.setdefault(replica.pid, self.last[replica.pid])

    def total(self) -> float:
        self.done.set()
        self.join()
        return sum(self.last[pid] - self.first[pid] for pid in self.last)


def write_input(path: Path, count: int, max_tokens: int) -> int:
    """Chat requests of 20 to 200 random words, each its own (no shared prefix): the replicas share them evenly."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(count):
            words = (
                "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(rng.randint(20, 200))
            )
            content = f"{i}: " + " ".join(words)
            messages = [{"role": "user", "content": content}]
            body = {"model": "demo", "messages": messages, "max_tokens": max_tokens, "ignore_eos": True}
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            f.write(json.dumps(line) + "\n")
    return count * max_tokens


def run_row(row: Row, source: Path, out: Path, max_num_seqs: int) -> None:
    config = EngineConfig(torch_threads=row.threads, max_num_seqs=max_num_seqs, num_kv_blocks=2048)
    engine = load_engine(config, ClusterConfig(replicas=row.replicas))
    replicas = ReplicaCpu(engine) if isinstance(engine, ReplicaPool) else None
    if replicas is not None:
        replicas.start()
    cpu = time.process_time()  # loading is not counted; the few ms before the batch starts are
    summary = run_batch(engine, source, out, progress=False)
    cpu = time.process_time() - cpu
    assert summary.completed == summary.total, summary
    row.seconds.append(summary.seconds)
    if replicas is None:
        row.engine_cpu.append(cpu)
    else:
        row.engine_cpu.append(replicas.total())
        row.server_cpu.append(cpu)
        row.shares = [replica.served_requests for replica in engine.replicas()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="each engine's running set")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    rows = [
        Row("in-process engine (no Ray)", 0, 1),
        Row(f"in-process engine, {cores} threads", 0, cores),
        Row("1 replica", 1, 1),
        Row("2 replicas", 2, 1),
    ]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="batchgen-replicas-") as tmp:
        source, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        tokens = write_input(source, args.requests, args.max_tokens)
        for round_number in range(args.rounds):
            for row in rows:
                run_row(row, source, out, args.max_num_seqs)
                print(f"round {round_number + 1}: {row.name}: {row.seconds[-1]:.2f} s", flush=True)
    load_after = os.getloadavg()[0]
    lines = table(rows, tokens)
    print("\n" + "\n".join(lines))
    if not args.no_results:
        append_results(args, lines, cores, (load_before, load_after))


def table(rows: list[Row], tokens: int) -> list[str]:
    one = next(row for row in rows if row.replicas == 1).best
    lines = [
        "| row | best s | median s | output tokens/s | vs 1 replica | of linear | engine CPU s | tokens / engine "
        "CPU s | server CPU s | results per replica |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        speedup = one / row.best
        linear = f"{speedup / row.replicas:.0%}" if row.replicas > 1 else ""
        engine_cpu = row.engine_cpu[row.best_round]
        server_cpu = f"{row.server_cpu[row.best_round]:.1f}" if row.server_cpu else ""
        shares = " / ".join(map(str, row.shares))
        lines.append(
            f"| {row.name} | {row.best:.2f} | {statistics.median(row.seconds):.2f} | {tokens / row.best:,.0f} "
            f"| {speedup:.2f}x | {linear} | {engine_cpu:.1f} | {tokens / engine_cpu:,.0f} | {server_cpu} | {shares} |"
        )
    return lines


def append_results(args: argparse.Namespace, lines: list[str], cores: int, load: tuple[float, float]) -> None:
    text = [
        "",
        "## Replicas",
        "",
        f"`python benchmarks/replicas.py` on {platform.machine()}, {cores} cores, CPU, demo model, "
        f"{time.strftime('%Y-%m-%d')}: {args.requests} chat requests x {args.max_tokens} tokens (ignore_eos), "
        f"`--max-num-seqs {args.max_num_seqs}` per engine, best of {args.rounds} interleaved rounds; load average "
        f"{load[0]:.1f} before, {load[1]:.1f} after.",
        "",
        *lines,
        "",
    ]
    append_section(text)


if __name__ == "__main__":
    main()
