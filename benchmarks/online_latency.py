"""Online latency benchmark: does a chat call wait behind a batch that saturates the engine?

Streams the same short chat call (16 tokens) ``--calls`` times with the engine idle, then again while a batch of
long requests (4 x ``--max-num-seqs`` lines of 1,500 tokens) fills the running set and the engine's queue: the time
to the first token and to the whole answer, p50 and p95, and their busy/idle ratios. For contrast, the same request
as a one-line batch created while the big batch runs: what the call would wait without its priority (a batch line
takes its turn for a free place in the engine).

    python benchmarks/online_latency.py [--calls 20] [--max-num-seqs 16] [--no-results]

Appends an "Online latency" section to benchmarks/RESULTS.md unless ``--no-results``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from batchgen.server.launcher import ServerProcess

RESULTS = Path(__file__).parent / "RESULTS.md"
CALL = {
    "model": "demo",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 16,
    "ignore_eos": True,
}


def streamed_call(http: httpx.Client) -> tuple[float, float]:
    """Seconds to the first token and to the end of a streamed chat call."""
    start = time.perf_counter()
    first = None
    with http.stream("POST", "/v1/chat/completions", json={**CALL, "stream": True}) as stream:
        stream.raise_for_status()
        for line in stream.iter_lines():
            if (
                first is None
                and line.startswith("data: {")
                and json.loads(line[6:])["choices"][0]["delta"].get("content")
            ):
                first = time.perf_counter() - start
    assert first is not None, "no token streamed"
    return first, time.perf_counter() - start


def measure(http: httpx.Client, calls: int) -> tuple[list[float], list[float]]:
    results = [streamed_call(http) for _ in range(calls)]
    return [r[0] for r in results], [r[1] for r in results]


def p50_p95(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(len(ordered) * 0.95) - 1)]


def submit(http: httpx.Client, lines: list[dict[str, object]]) -> str:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)}).json()["id"]
    batch_id: str = http.post("/v1/batches", json={"input_file_id": file_id}).json()["id"]
    return batch_id


def line(custom_id: str, body: dict[str, object]) -> dict[str, object]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20, help="streamed chat calls per phase")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="the engine's running set")
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()

    flags = ("--max-num-seqs", str(args.max_num_seqs), "--torch-threads", "1")
    with tempfile.TemporaryDirectory(prefix="batchgen-bench-") as tmp, ServerProcess(Path(tmp), *flags) as server:
        http = httpx.Client(base_url=server.base_url, timeout=600)
        measure(http, 3)  # warm up
        idle = measure(http, args.calls)

        long_body = {**CALL, "max_tokens": 1500}
        big = submit(http, [line(f"long-{i}", long_body) for i in range(4 * args.max_num_seqs)])
        deadline = time.monotonic() + 120
        while http.get("/v1/pool/status").json()["running_requests"] < args.max_num_seqs:
            assert time.monotonic() < deadline, "the batch never filled the engine"
            time.sleep(0.05)
        busy = measure(http, args.calls)
        start = time.perf_counter()
        small = submit(http, [line("one", CALL)])
        while http.get(f"/v1/batches/{small}").json()["status"] != "completed":
            time.sleep(0.05)
        one_line_batch = time.perf_counter() - start
        status = http.get(f"/v1/batches/{big}").json()
        running = http.get("/v1/pool/status").json()["running_requests"]
        http.post(f"/v1/batches/{big}/cancel")
        http.close()

    rows = []
    for label, (idle_samples, busy_samples) in (
        ("first token", (idle[0], busy[0])),
        ("whole answer", (idle[1], busy[1])),
    ):
        (idle_p50, idle_p95), (busy_p50, busy_p95) = p50_p95(idle_samples), p50_p95(busy_samples)
        rows.append((label, idle_p50, idle_p95, busy_p50, busy_p95, busy_p50 / idle_p50))
    done = status["request_counts"]["completed"]
    print(f"\nStreamed chat call, 16 tokens ({args.calls} calls per phase; --max-num-seqs {args.max_num_seqs})")
    print(f"{'':<14} {'idle p50':>9} {'idle p95':>9} {'busy p50':>9} {'busy p95':>9} {'busy/idle p50':>13}")
    for label, a, b, c, d, ratio in rows:
        print(
            f"{label:<14} {a * 1000:>7.0f}ms {b * 1000:>7.0f}ms {c * 1000:>7.0f}ms {d * 1000:>7.0f}ms {ratio:>12.2f}x"
        )
    print(f"the same request as a one-line batch while busy: {one_line_batch:.2f} s")
    print(f"big batch: {done} of {4 * args.max_num_seqs} requests done at the end; {running} sequences running")
    if not args.no_results:
        append_results(rows, one_line_batch, args, done, running)


def append_results(
    rows: list[tuple[str, float, float, float, float, float]],
    one_line_batch: float,
    args: argparse.Namespace,
    done: int,
    running: int,
) -> None:
    lines = [
        "",
        "## Online latency",
        "",
        f"`python benchmarks/online_latency.py` on {platform.machine()}, CPU, demo model, "
        f"{time.strftime('%Y-%m-%d')}, `--max-num-seqs {args.max_num_seqs} --torch-threads 1`. A streamed chat call "
        f"(16 tokens), {args.calls} times with the engine idle, then while a batch of {4 * args.max_num_seqs} "
        f"requests of 1,500 tokens fills the running set and the engine's queue ({done} of them done, {running} "
        "sequences running at the end).",
        "",
        "| streamed chat call | idle p50 | idle p95 | busy p50 | busy p95 | busy/idle p50 |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {r[0]} | {r[1] * 1000:.0f} ms | {r[2] * 1000:.0f} ms | {r[3] * 1000:.0f} ms | {r[4] * 1000:.0f} ms "
            f"| {r[5]:.2f}x |"
            for r in rows
        ),
        f"| the same request as a one-line batch, while busy | | | {one_line_batch * 1000:.0f} ms | | |",
        "",
    ]
    with open(RESULTS, "a") as f:
        f.write("\n".join(lines))
    print(f"\nappended to {RESULTS}")


if __name__ == "__main__":
    main()
