"""kill -9 at several points of a batch's life, then a restart on the same storage: every request answered once.

The soak script (``benchmarks/soak.py``) kills at random moments over many batches; these are the deterministic
points: right after the batch is accepted (validating), mid-decode, and again during the recovery itself.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from batchgen.server.launcher import ServerProcess
from server_helpers import LiveServer, chat_line


def kill_9(server: LiveServer) -> None:
    assert server.process.process is not None
    server.http.close()
    server.process.process.kill()
    server.process.process.wait()


def restart(storage: Path) -> LiveServer:
    return LiveServer(ServerProcess(storage).start())


def assert_exactly_once(server: LiveServer, batch: dict[str, Any], lines: list[dict[str, Any]]) -> None:
    assert batch["status"] == "completed", batch
    raw = b""
    for file_id in (batch["output_file_id"], batch["error_file_id"]):
        if file_id is not None:
            raw += server.http.get(f"/v1/files/{file_id}/content").raise_for_status().content
    assert raw.endswith(b"\n")
    answered = [json.loads(line) for line in raw.splitlines()]  # a torn line would not parse
    counts = Counter(line["custom_id"] for line in answered)
    assert counts == Counter(line["custom_id"] for line in lines)
    completed = [line for line in answered if line["error"] is None and line["response"]["status_code"] == 200]
    assert batch["request_counts"] == {"total": len(lines), "completed": len(completed), "failed": 0}
    usage = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in completed)
    assert batch["usage"]["output_tokens"] == usage == sum(line["body"]["max_tokens"] for line in lines)


def test_kill_right_after_the_batch_is_accepted(tmp_path: Path) -> None:
    lines = [chat_line(f"r{i}", content=f"request {i}", max_tokens=2, ignore_eos=True) for i in range(200)]
    server = restart(tmp_path)
    batch_id = server.create_batch(server.upload(lines)["id"])["id"]
    kill_9(server)  # while the batch is validating, or just after: the runner had milliseconds

    server = restart(tmp_path)
    try:
        assert_exactly_once(server, server.wait(batch_id, timeout_s=120), lines)
    finally:
        server.http.close()
        server.process.stop()


def test_kill_mid_decode_and_again_during_recovery(tmp_path: Path) -> None:
    lines = [chat_line(f"short-{i}", max_tokens=2, ignore_eos=True) for i in range(6)]
    lines += [chat_line(f"long-{i}", max_tokens=400, ignore_eos=True) for i in range(4)]
    server = restart(tmp_path)
    batch_id = server.create_batch(server.upload(lines)["id"])["id"]
    deadline = time.monotonic() + 60
    while (batch := server.batch(batch_id))["request_counts"]["completed"] < 6:
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    assert batch["status"] == "in_progress"
    kill_9(server)  # mid-decode: the short requests are written, the long ones are half-way

    server = restart(tmp_path)
    kill_9(server)  # at once: while the restarted runner re-reads the results and resubmits

    server = restart(tmp_path)
    try:
        assert_exactly_once(server, server.wait(batch_id, timeout_s=120), lines)
    finally:
        server.http.close()
        server.process.stop()
