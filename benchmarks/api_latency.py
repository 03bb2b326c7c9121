"""Server API benchmark: does the API stay fast while the engine is saturated, and do uploads stream?

1. p50/p99 latency of ``GET /v1/batches/{id}`` and ``GET /v1/files`` with the engine idle (baseline), then while a
   large batch keeps it saturated (same process, same server); the ratio shows what saturation costs.
2. Upload throughput and the server's peak memory (RSS, sampled every 10 ms) for a ~200 MB input file.

    python benchmarks/api_latency.py [--requests 400] [--upload-mb 200] [--no-results]

Appends a "Server API" section to benchmarks/RESULTS.md unless ``--no-results``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from batchgen.server.launcher import ServerProcess

RESULTS = Path(__file__).parent / "RESULTS.md"


def append_section(lines: list[str]) -> None:
    """Append a section (its lines, heading first) to RESULTS.md, as every benchmark script here does."""
    if not RESULTS.exists():
        RESULTS.write_text("# Benchmark results\n")
    with open(RESULTS, "a") as f:
        f.write("\n".join(lines))
    print(f"\nappended to {RESULTS}")


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def measure(http: httpx.Client, path: str, count: int) -> list[float]:
    latencies = []
    for _ in range(count):
        start = time.perf_counter()
        response = http.get(path)
        latencies.append((time.perf_counter() - start) * 1000)
        response.raise_for_status()
    return latencies


def saturate(http: httpx.Client, requests: int, max_tokens: int) -> str:
    lines = [
        {
            "custom_id": f"load-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "demo",
                "messages": [{"role": "user", "content": f"Keep going {i}"}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
            },
        }
        for i in range(requests)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("load.jsonl", content)}).json()["id"]
    batch_id: str = http.post("/v1/batches", json={"input_file_id": file_id}).json()["id"]
    deadline = time.monotonic() + 60
    while http.get("/v1/pool/status").json()["running_requests"] == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("the engine never started running the load batch")
        time.sleep(0.05)
    return batch_id


def write_big_file(path: Path, target_bytes: int) -> int:
    """Valid JSONL of ~4 KB chat requests (under the 50,000-request limit at 200 MB)."""
    filler = "lorem ipsum dolor sit amet " * 150
    written = 0
    with open(path, "w") as f:
        i = 0
        while written < target_bytes:
            line = json.dumps(
                {
                    "custom_id": f"big-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": "demo", "messages": [{"role": "user", "content": filler}], "max_tokens": 1},
                }
            )
            f.write(line + "\n")
            written += len(line) + 1
            i += 1
    return written


class RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_kib = 0
        self._stop_event = threading.Event()

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak_kib = max(self.peak_kib, self.rss_kib())
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400, help="GETs per endpoint and phase")
    parser.add_argument("--upload-mb", type=int, default=200)
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="batchgen-bench-") as tmp, ServerProcess(Path(tmp) / "storage") as server:
        assert server.process is not None
        http = httpx.Client(base_url=server.base_url, timeout=120)
        for i in range(50):  # a realistic listing: 50 files
            http.post("/v1/files", data={"purpose": "batch"}, files={"file": (f"f{i}.jsonl", b'{"a": 1}\n')})
        idle_batch = http.post("/v1/batches", json={"input_file_id": http.get("/v1/files").json()["data"][0]["id"]})
        idle_id = idle_batch.json()["id"]
        measure(http, f"/v1/batches/{idle_id}", 20)  # warm up
        rows = []
        baseline = {path: measure(http, path, args.requests) for path in (f"/v1/batches/{idle_id}", "/v1/files")}

        load_id = saturate(http, requests=64, max_tokens=2000)
        loaded = {path: measure(http, path, args.requests) for path in (f"/v1/batches/{load_id}", "/v1/files")}
        running = http.get("/v1/pool/status").json()["running_requests"]
        assert running > 0, "the engine was not saturated during the measurement"
        http.post(f"/v1/batches/{load_id}/cancel")

        for (name, idle), (_, busy) in zip(baseline.items(), loaded.items(), strict=True):
            label = "GET /v1/batches/{id}" if "batches" in name else "GET /v1/files (50 files)"
            (p50_idle, p99_idle), (p50_busy, p99_busy) = percentiles(idle), percentiles(busy)
            rows.append((label, p50_idle, p99_idle, p50_busy, p99_busy, p99_busy / p99_idle))

        big = Path(tmp) / "big.jsonl"
        size = write_big_file(big, args.upload_mb * 1_000_000)
        sampler = RssSampler(server.process.pid)
        rss_before = sampler.rss_kib()
        sampler.start()
        start = time.perf_counter()
        with open(big, "rb") as f:
            response = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", f)})
        upload_s = time.perf_counter() - start
        sampler.stop()
        response.raise_for_status()
        http.close()

    print(f"\nServer API latency ({args.requests} sequential GETs each; engine saturated by 64 x 2000-token requests)")
    print(f"{'endpoint':<26} {'idle p50':>9} {'idle p99':>9} {'busy p50':>9} {'busy p99':>9} {'p99 ratio':>9}")
    for label, a, b, c, d, ratio in rows:
        print(f"{label:<26} {a:>7.2f}ms {b:>7.2f}ms {c:>7.2f}ms {d:>7.2f}ms {ratio:>8.2f}x")
    print(f"sequences still running in the engine at the end of the busy phase: {running}")
    mb = size / 1e6
    peak_delta_mib = (sampler.peak_kib - rss_before) / 1024
    print(f"\nupload of {mb:.0f} MB: {upload_s:.1f} s = {mb / upload_s:.0f} MB/s")
    print(f"server RSS: {rss_before / 1024:.0f} MiB before, peak {sampler.peak_kib / 1024:.0f} MiB during the upload")
    print(f"(+{peak_delta_mib:.0f} MiB for a {mb:.0f} MB file)")

    if not args.no_results:
        append_results(rows, running, mb, upload_s, rss_before, sampler.peak_kib, args.requests)


def append_results(
    rows: list[tuple[str, float, float, float, float, float]],
    running: int,
    mb: float,
    upload_s: float,
    rss_before_kib: int,
    peak_kib: int,
    requests: int,
) -> None:
    lines = [
        "",
        "## Server API",
        "",
        f"`python benchmarks/api_latency.py` on {platform.machine()}, CPU, demo model, {time.strftime('%Y-%m-%d')}. "
        f"{requests} sequential GETs per endpoint, first with the engine idle, then while 64 x 2000-token requests "
        f"keep it saturated ({running} sequences still running when the measurement ended). Target: busy p99 < 50 ms.",
        "",
        "| endpoint | idle p50 | idle p99 | busy p50 | busy p99 | busy/idle p99 |",
        "|---|---:|---:|---:|---:|---:|",
        *(f"| {r[0]} | {r[1]:.2f} ms | {r[2]:.2f} ms | {r[3]:.2f} ms | {r[4]:.2f} ms | {r[5]:.2f}x |" for r in rows),
        "",
        "| upload | size | time | throughput | server RSS before | peak RSS during upload | peak increase |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| multipart, streamed to disk with sha256 and the JSONL check | {mb:.0f} MB | {upload_s:.1f} s | "
        f"{mb / upload_s:.0f} MB/s | {rss_before_kib / 1024:.0f} MiB | {peak_kib / 1024:.0f} MiB | "
        f"+{(peak_kib - rss_before_kib) / 1024:.0f} MiB |",
        "",
    ]
    append_section(lines)


if __name__ == "__main__":
    main()
