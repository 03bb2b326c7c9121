"""Durability across a restart: a batch interrupted by SIGTERM resumes on the same storage and answers every
request exactly once; files and batches are still there."""

from __future__ import annotations

import time
from pathlib import Path

from server_helpers import LiveServer, chat_line

from batchgen.server.launcher import CLEAN_EXIT_CODES, ServerProcess


def test_interrupted_batch_resumes_exactly_once(tmp_path: Path) -> None:
    lines = [chat_line(f"short-{i}", max_tokens=2, ignore_eos=True) for i in range(4)]
    lines += [chat_line(f"long-{i}", max_tokens=600, ignore_eos=True) for i in range(4)]
    first = LiveServer(ServerProcess(tmp_path).start())
    try:
        file_id = first.upload(lines)["id"]
        batch_id = first.create_batch(file_id)["id"]
        deadline = time.monotonic() + 30
        while first.batch(batch_id)["request_counts"]["completed"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert first.batch(batch_id)["status"] == "in_progress"
    finally:
        first.http.close()
        assert first.process.stop() in CLEAN_EXIT_CODES

    second = LiveServer(ServerProcess(tmp_path).start())
    try:
        batch = second.wait(batch_id, timeout_s=60)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
        output = second.lines(batch["output_file_id"])
        assert sorted(line["custom_id"] for line in output) == sorted(line["custom_id"] for line in lines)
        assert batch["usage"]["output_tokens"] == 4 * 2 + 4 * 600
        assert second.http.get(f"/v1/files/{file_id}").status_code == 200
    finally:
        second.http.close()
        second.process.stop()
