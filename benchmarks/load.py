"""Load: 50 concurrent clients upload, create and poll for 60 s while the engine is busy; zero errors expected.

Before the clients start, one big batch saturates the engine. Each client then loops: upload a small input file,
create a batch from it, poll it and list files. Every answer must be a 2xx; latency is reported per operation.

    python benchmarks/load.py                  # 50 clients, 60 s, own server on a free loopback port
    python benchmarks/load.py --duration 15    # shorter
    python benchmarks/load.py --url http://127.0.0.1:10900 --api-key KEY   # an already running server

Talks only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from batchgen.server.launcher import ServerProcess


def input_file(model: str, prefix: str, requests: int, max_tokens: int) -> bytes:
    lines = [
        json.dumps(
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"{prefix}: tell me about the number {i}."}],
                    "max_tokens": max_tokens,
                },
            }
        )
        for i in range(requests)
    ]
    return ("\n".join(lines) + "\n").encode()


class Recorder:
    def __init__(self) -> None:
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.errors: list[str] = []

    async def timed(self, name: str, request: Any) -> httpx.Response | None:
        started = time.perf_counter()
        try:
            response: httpx.Response = await request
        except httpx.HTTPError as exc:
            self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
            return None
        self.latencies[name].append(time.perf_counter() - started)
        if not response.is_success:
            self.errors.append(f"{name}: HTTP {response.status_code} {response.text[:200]}")
            return None
        return response


async def upload(client: httpx.AsyncClient, recorder: Recorder, name: str, content: bytes) -> str | None:
    files = {"file": (f"{name}.jsonl", content, "application/jsonl")}
    response = await recorder.timed("POST /v1/files", client.post("/v1/files", files=files, data={"purpose": "batch"}))
    return None if response is None else str(response.json()["id"])


async def create(client: httpx.AsyncClient, recorder: Recorder, file_id: str) -> str | None:
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    response = await recorder.timed("POST /v1/batches", client.post("/v1/batches", json=body))
    return None if response is None else str(response.json()["id"])


async def client_loop(
    client: httpx.AsyncClient, recorder: Recorder, index: int, model: str, stop_at: float, polls: int
) -> int:
    rounds = 0
    while time.monotonic() < stop_at:
        rounds += 1
        file_id = await upload(
            client, recorder, f"load-{index}-{rounds}", input_file(model, f"c{index}r{rounds}", 4, 8)
        )
        batch_id = None if file_id is None else await create(client, recorder, file_id)
        for _ in range(polls if batch_id else 0):
            await recorder.timed("GET /v1/batches/{id}", client.get(f"/v1/batches/{batch_id}"))
            await asyncio.sleep(0.2)
        await recorder.timed("GET /v1/files", client.get("/v1/files", params={"limit": 20}))
    return rounds


async def run(base_url: str, api_key: str | None, clients: int, duration_s: float, busy_requests: int) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # Pooled connections expire well before uvicorn closes idle ones (5 s): reusing a connection at the moment the
    # server closes it is a client-side race (ReadError), not a server error.
    limits = httpx.Limits(max_connections=clients + 4, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60, limits=limits) as client:
        model = (await client.get("/v1/models")).raise_for_status().json()["data"][0]["id"]
        warmup = Recorder()
        busy_file = await upload(client, warmup, "busy", input_file(model, "busy", busy_requests, 128))
        busy_batch = None if busy_file is None else await create(client, warmup, busy_file)
        if busy_batch is None:
            print("could not start the busy batch:", warmup.errors, file=sys.stderr)
            return 2
        recorder = Recorder()
        stop_at = time.monotonic() + duration_s
        started = time.monotonic()
        rounds = await asyncio.gather(
            *(client_loop(client, recorder, i, model, stop_at, polls=3) for i in range(clients))
        )
        elapsed = time.monotonic() - started
        busy = (await client.get(f"/v1/batches/{busy_batch}")).json()
        pool = (await client.get("/v1/pool/status")).json()

    print(f"\nload: {clients} clients for {elapsed:.0f} s, {sum(rounds)} upload+create+poll rounds")
    busy_throughout = busy["status"] == "in_progress"
    print(f"engine busy throughout: {busy_throughout} (busy batch {busy['status']}, {busy['request_counts']})")
    print(f"pool at the end: {pool}")
    print(f"\n{'operation':<24}{'count':>8}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for name, values in sorted(recorder.latencies.items()):
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        print(
            f"{name:<24}{len(values):>8}{statistics.median(values) * 1e3:>10.1f}{p99 * 1e3:>10.1f}"
            f"{ordered[-1] * 1e3:>10.1f}"
        )
    print(f"\nerrors: {len(recorder.errors)}")
    for error in recorder.errors[:20]:
        print("  ", error)
    return 1 if recorder.errors else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument(
        "--busy-requests", type=int, default=20_000, help="requests of the batch keeping the engine busy"
    )
    parser.add_argument("--url", default=None, help="an already running server (default: start one)")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    with ExitStack() as stack:
        if args.url is None:
            storage = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="batchgen-load-")))
            base_url = stack.enter_context(ServerProcess(storage)).base_url
        else:
            if urlsplit(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
                parser.error("--url must be a loopback address")
            base_url = args.url
        return asyncio.run(run(base_url, args.api_key, args.clients, args.duration, args.busy_requests))
    return 1


if __name__ == "__main__":
    sys.exit(main())
