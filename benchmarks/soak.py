"""Soak: SIGKILL and restart the server at random moments over many batches, then check exactly-once output.

A killer thread SIGKILLs the server at random intervals (during uploads, validation, decoding, finalization: wherever
it lands) and restarts it on the same storage; the main thread keeps a few batches in flight, retrying calls cut by a
kill (creates carry an Idempotency-Key, so a retry never makes a twin). At the end every batch on the server must be
``completed`` and, for each: every custom_id of its input exactly once across the output and error files, every line
whole JSON, ``request_counts`` and ``usage`` equal to what the lines say. Finally SIGTERM must drain within 30 s.

    python benchmarks/soak.py                           # 60 batches x 200 requests, up to 10 kills, <= 15 min
    python benchmarks/soak.py --batches 6 --kills 3     # a quick pass

Talks only to 127.0.0.1. Exit status 0 only when nothing was lost, duplicated or torn.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from batchgen.server.launcher import ServerProcess

TERMINAL = {"completed", "failed", "expired", "cancelled"}


class Api:
    """httpx calls that ride out a server being killed and restarted underneath them."""

    def __init__(self, base_url: str, deadline: float) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=30)
        self.deadline = deadline
        self.retries = 0

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        while True:
            try:
                response = self.client.request(method, path, **kwargs)
            except httpx.TransportError:
                response = None
            if response is not None and response.status_code not in (502, 503):
                response.raise_for_status()
                return response
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"{method} {path}: server unreachable until the deadline")
            self.retries += 1
            time.sleep(0.25)


@dataclass
class Killer:
    """SIGKILLs the server at uniformly random intervals and restarts it, until told to stop or out of kills."""

    server: ServerProcess
    rng: random.Random
    interval_s: tuple[float, float]
    max_kills: int
    kills: int = 0
    restart_s: list[float] = field(default_factory=list)
    phases: Counter[str] = field(default_factory=Counter)
    """Statuses of the unfinished batches at each kill: where the kills landed."""
    error: BaseException | None = None
    stopped: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        try:
            while self.kills < self.max_kills and not self.stopped.wait(self.rng.uniform(*self.interval_s)):
                assert self.server.process is not None
                self.phases.update(self._unfinished_statuses())
                self.server.process.kill()
                self.server.process.wait()
                started = time.monotonic()
                self.server.start()
                self.restart_s.append(time.monotonic() - started)
                self.kills += 1
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def _unfinished_statuses(self) -> list[str]:
        try:
            page = httpx.get(f"{self.server.base_url}/v1/batches", params={"limit": 100}, timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return ["(no answer)"]
        return [batch["status"] for batch in page["data"] if batch["status"] not in TERMINAL] or ["(idle)"]


def make_input(index: int, requests: int, model: str, rng: random.Random) -> tuple[str, bytes, set[str]]:
    endpoint = "/v1/chat/completions" if index % 2 == 0 else "/v1/completions"
    lines, ids = [], set()
    for r in range(requests):
        custom_id = f"b{index:03d}-r{r:04d}"
        prompt = f"Batch {index}, request {r}: count from {r} upwards."
        body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(4, 64), "temperature": 0}
        if endpoint == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        lines.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}))
        ids.add(custom_id)
    return endpoint, ("\n".join(lines) + "\n").encode(), ids


def submit(api: Api, index: int, endpoint: str, content: bytes) -> str:
    file = api.call(
        "POST",
        "/v1/files",
        files={"file": (f"soak-{index}.jsonl", content, "application/jsonl")},
        data={"purpose": "batch"},
        headers={"Idempotency-Key": f"soak-file-{index}-{uuid.uuid4().hex}"},
    ).json()
    batch = api.call(
        "POST",
        "/v1/batches",
        json={"input_file_id": file["id"], "endpoint": endpoint, "completion_window": "24h"},
        headers={"Idempotency-Key": f"soak-batch-{index}-{file['id']}"},
    ).json()
    return str(batch["id"])


def all_batches(api: Api) -> list[dict[str, Any]]:
    batches: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 100, **({"after": after} if after else {})}
        page = api.call("GET", "/v1/batches", params=params).json()
        batches.extend(page["data"])
        if not page["has_more"]:
            return batches
        after = page["last_id"]


@dataclass
class Check:
    requests: int = 0
    completed: int = 0
    failed: int = 0
    lost: int = 0
    duplicated: int = 0
    torn: int = 0
    wrong_counts: int = 0
    wrong_usage: int = 0
    not_completed: list[str] = field(default_factory=list)


def lines_of(api: Api, file_id: str | None) -> list[bytes]:
    if file_id is None:
        return []
    return [line for line in api.call("GET", f"/v1/files/{file_id}/content").content.split(b"\n") if line]


def check_batch(api: Api, batch: dict[str, Any], expected: set[str], check: Check) -> None:
    check.requests += len(expected)
    if batch["status"] != "completed":
        check.not_completed.append(f"{batch['id']}: {batch['status']} {batch.get('errors')}")
    seen: Counter[str] = Counter()
    prompt_tokens = completion_tokens = 0
    output, errors = lines_of(api, batch["output_file_id"]), lines_of(api, batch["error_file_id"])
    for raw in output + errors:
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            check.torn += 1
            continue
        seen[line["custom_id"]] += 1
        usage = ((line.get("response") or {}).get("body") or {}).get("usage") or {}
        prompt_tokens += usage.get("prompt_tokens", 0)
        completion_tokens += usage.get("completion_tokens", 0)
    check.completed += len(output)
    check.failed += len(errors)
    check.lost += len(expected - seen.keys())
    check.duplicated += sum(count - 1 for count in seen.values()) + len(seen.keys() - expected)
    counts = batch["request_counts"]
    if (counts["total"], counts["completed"], counts["failed"]) != (len(expected), len(output), len(errors)):
        check.wrong_counts += 1
    usage = batch["usage"]
    if (usage["input_tokens"], usage["output_tokens"]) != (prompt_tokens, completion_tokens):
        check.wrong_usage += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--requests", type=int, default=200, help="requests per batch")
    parser.add_argument("--in-flight", type=int, default=3, help="batches kept running at once")
    parser.add_argument("--kills", type=int, default=10, help="most SIGKILLs")
    parser.add_argument("--interval", type=float, nargs=2, default=(1.0, 6.0), metavar=("MIN_S", "MAX_S"))
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds for the whole soak")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--storage", type=Path, default=None, help="storage dir (default: a fresh temporary one)")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    storage = args.storage or Path(tempfile.mkdtemp(prefix="batchgen-soak-"))
    started = time.monotonic()
    deadline = started + args.time_limit
    server = ServerProcess(storage).start()
    api = Api(server.base_url, deadline)
    model = api.call("GET", "/v1/models").json()["data"][0]["id"]
    inputs = {i: make_input(i, args.requests, model, rng) for i in range(args.batches)}
    killer = Killer(server, random.Random(args.seed + 1), (args.interval[0], args.interval[1]), args.kills)
    killer_thread = threading.Thread(target=killer.run, daemon=True)
    killer_thread.start()

    expected_by_batch: dict[str, set[str]] = {}
    waiting = list(range(args.batches))
    running: list[str] = []
    try:
        while (waiting or running) and time.monotonic() < deadline and killer.error is None:
            while waiting and len(running) < args.in_flight:
                index = waiting.pop(0)
                endpoint, content, ids = inputs[index]
                batch_id = submit(api, index, endpoint, content)
                expected_by_batch[batch_id] = ids
                running.append(batch_id)
            running = [b for b in running if api.call("GET", f"/v1/batches/{b}").json()["status"] not in TERMINAL]
            time.sleep(0.5)
    finally:
        killer.stopped.set()
        killer_thread.join()
    if killer.error is not None:
        print(f"restart failed: {killer.error}\n{server.log_tail()}", file=sys.stderr)
        return 2

    check = Check()
    batches = all_batches(api)
    for batch in batches:
        # A batch the client never heard of (its create answer lost to a kill) must be whole all the same.
        expected = expected_by_batch.get(batch["id"])
        if expected is None:
            check.not_completed.append(f"{batch['id']}: unknown to the client (a twin of a retried create?)")
            continue
        check_batch(api, batch, expected, check)
    missing_batches = expected_by_batch.keys() - {b["id"] for b in batches}
    drain_started = time.monotonic()
    exit_code = server.stop(timeout_s=30)
    drain_s = time.monotonic() - drain_started
    # uvicorn re-raises SIGTERM after its graceful shutdown, so a drained server reports -15; -9 means it was killed.
    drained = exit_code in (0, -signal.SIGTERM)

    rows = [
        ("kills survived (SIGKILL + restart)", killer.kills),
        ("batches in flight at the kills", ", ".join(f"{k} x{v}" for k, v in killer.phases.most_common()) or "-"),
        ("mean restart to healthy (s)", f"{sum(killer.restart_s) / max(len(killer.restart_s), 1):.1f}"),
        ("batches submitted / on the server", f"{len(expected_by_batch)} / {len(batches)}"),
        ("batches not submitted (time limit)", len(waiting)),
        ("batches not completed", len(check.not_completed) + len(missing_batches)),
        ("requests", check.requests),
        ("output lines / error lines", f"{check.completed} / {check.failed}"),
        ("lost", check.lost),
        ("duplicated", check.duplicated),
        ("torn lines", check.torn),
        ("batches with wrong request_counts", check.wrong_counts),
        ("batches with wrong usage", check.wrong_usage),
        ("client retries across kills", api.retries),
        ("SIGTERM: drained, exit code, seconds", f"{drained}, {exit_code}, {drain_s:.1f}"),
        ("wall time (s)", f"{time.monotonic() - started:.0f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"\n{'soak':<{width}}  value\n{'-' * width}  -----")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for problem in check.not_completed:
        print("not completed:", problem, file=sys.stderr)
    bad = (
        check.lost + check.duplicated + check.torn + check.wrong_counts + check.wrong_usage
        or check.not_completed
        or missing_batches
        or waiting
        or not drained
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
