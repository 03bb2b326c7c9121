"""Web console benchmark: what one open console tab costs the server, idle and with the engine saturated.

The console redraws every 2 s from the JSON API. One overview refresh is the four calls the page makes at once
(``/health``, ``/v1/pool/status``, ``/v1/batches?limit=100``, ``/v1/files?limit=100``); one batch-page refresh is the
batch, its three files' metadata and its error file. Each is timed as the browser issues it (concurrently), over a
server holding 100 finished batches (300 files), first with the engine idle, then while a large batch saturates it.

    python benchmarks/console_refresh.py [--refreshes 200] [--no-results]

Appends a "Web console" section to benchmarks/RESULTS.md unless ``--no-results``.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import httpx
from api_latency import append_section, percentiles, saturate

from batchgen.server.launcher import ServerProcess

REFRESH_INTERVAL_S = 2.0
BATCHES = 100


def chat(custom_id: str, content: str) -> str:
    body = {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def fill(http: httpx.Client) -> str:
    """100 finished batches, each with an output and an error file; the id of the last."""
    batch_ids = []
    for i in range(BATCHES):
        content = f"{chat('ok', f'Hello {i}')}\n{chat('too-long', 'x' * 2100)}\n".encode()
        upload = http.post("/v1/files", data={"purpose": "batch"}, files={"file": (f"in-{i}.jsonl", content)})
        batch_ids.append(http.post("/v1/batches", json={"input_file_id": upload.json()["id"]}).json()["id"])
    for batch_id in batch_ids:
        while http.get(f"/v1/batches/{batch_id}").json()["status"] != "completed":
            time.sleep(0.05)
    return batch_ids[-1]


def refresh(http: httpx.Client, pool: ThreadPoolExecutor, paths: list[str]) -> tuple[float, int]:
    """Milliseconds for the calls issued together, and the bytes they returned."""
    start = time.perf_counter()
    responses = list(pool.map(http.get, paths))
    elapsed = (time.perf_counter() - start) * 1000
    for response in responses:
        response.raise_for_status()
    return elapsed, sum(len(response.content) for response in responses)


def measure(http: httpx.Client, paths: list[str], count: int) -> tuple[list[float], int]:
    with ThreadPoolExecutor(len(paths)) as pool:
        runs = [refresh(http, pool, paths) for _ in range(count)]
    return [ms for ms, _ in runs], runs[-1][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refreshes", type=int, default=200, help="refreshes per page and phase")
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="batchgen-bench-") as tmp, ServerProcess(Path(tmp) / "storage") as server:
        http = httpx.Client(base_url=server.base_url, timeout=120)
        batch_id = fill(http)
        batch = http.get(f"/v1/batches/{batch_id}").json()
        file_ids = [batch["input_file_id"], batch["output_file_id"], batch["error_file_id"]]
        pages = {
            "overview (4 calls)": ["/health", "/v1/pool/status", "/v1/batches?limit=100", "/v1/files?limit=100"],
            "batch page (5 calls)": [
                f"/v1/batches/{batch_id}",
                *(f"/v1/files/{file_id}" for file_id in file_ids),
                f"/v1/files/{batch['error_file_id']}/content",
            ],
        }
        measure(http, pages["overview (4 calls)"], 10)  # warm up
        idle = {name: measure(http, paths, args.refreshes) for name, paths in pages.items()}
        load_id = saturate(http, requests=64, max_tokens=2000)
        busy = {name: measure(http, paths, args.refreshes) for name, paths in pages.items()}
        running = http.get("/v1/pool/status").json()["running_requests"]
        assert running > 0, "the engine was not saturated during the measurement"
        http.post(f"/v1/batches/{load_id}/cancel")
        http.close()

    rows = []
    for name in pages:
        (idle_ms, size), (busy_ms, _) = idle[name], busy[name]
        (p50_idle, p99_idle), (p50_busy, p99_busy) = percentiles(idle_ms), percentiles(busy_ms)
        share = p50_busy / (REFRESH_INTERVAL_S * 1000) * 100
        rows.append((name, size / 1000, p50_idle, p99_idle, p50_busy, p99_busy, p99_busy / p99_idle, share))

    print(f"\nOne console refresh ({args.refreshes} each; {BATCHES} batches, {3 * BATCHES} files on the server)")
    print(f"{'page':<22} {'size':>8} {'idle p50':>9} {'idle p99':>9} {'busy p50':>9} {'busy p99':>9} {'ratio':>6}")
    for name, kb, a, b, c, d, ratio, share in rows:
        print(f"{name:<22} {kb:>6.1f}kB {a:>7.2f}ms {b:>7.2f}ms {c:>7.2f}ms {d:>7.2f}ms {ratio:>5.2f}x ({share:.1f}%)")
    print(f"sequences still running in the engine at the end of the busy phase: {running}")
    if not args.no_results:
        append_results(rows, running, args.refreshes)


def append_results(
    rows: list[tuple[str, float, float, float, float, float, float, float]], running: int, n: int
) -> None:
    lines = [
        "",
        "## Web console",
        "",
        f"`python benchmarks/console_refresh.py` on {platform.machine()}, CPU, demo model, {date.today()}. "
        f"{n} refreshes per page, each the page's calls issued at once as the browser does, over a server holding "
        f"{BATCHES} finished batches ({3 * BATCHES} files); first with the engine idle, then while 64 x 2000-token "
        f"requests keep it saturated ({running} sequences still running at the end). The last column: how much of "
        f"the 2 s refresh interval a busy refresh takes (p50).",
        "",
        "| page | bytes per refresh | idle p50 | idle p99 | busy p50 | busy p99 | busy/idle p99 | of 2 s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r[0]} | {r[1]:.1f} kB | {r[2]:.2f} ms | {r[3]:.2f} ms | {r[4]:.2f} ms | {r[5]:.2f} ms | "
            f"{r[6]:.2f}x | {r[7]:.1f}% |"
            for r in rows
        ),
        "",
    ]
    append_section(lines)


if __name__ == "__main__":
    main()
