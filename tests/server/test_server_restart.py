"""Durability across a restart: SIGTERM mid-batch drains (new work gets 503, the process exits within its shutdown
deadline), and the batch resumes on the same storage answering every request exactly once."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import LiveServer, ServerProcess, chat_line, jsonl

from batchgen.server.launcher import CLEAN_EXIT_CODES

SHUTDOWN_TIMEOUT_S = 10
BOUNDARY = "drain-test-boundary"


def slow_upload(started: threading.Event, resume: threading.Event) -> Iterator[bytes]:
    """A multipart upload whose end arrives only after ``resume``: it is in flight when SIGTERM comes."""
    yield (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="late.jsonl"\r\n\r\n'
    ).encode()
    started.set()
    resume.wait(30)
    yield jsonl([chat_line("late")]) + f"\r\n--{BOUNDARY}--\r\n".encode()


def test_sigterm_drains_and_the_batch_resumes_exactly_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [chat_line(f"short-{i}", max_tokens=2, ignore_eos=True) for i in range(4)]
    lines += [chat_line(f"long-{i}", max_tokens=600, ignore_eos=True) for i in range(4)]
    # Every interface and no key: refused unless insecure, here through the variable (the CLI test checks refusal).
    monkeypatch.setenv("BATCHGEN_INSECURE", "1")
    process = ServerProcess(tmp_path, "--host", "0.0.0.0", "--shutdown-timeout-s", str(SHUTDOWN_TIMEOUT_S))
    first = LiveServer(process.start())
    monkeypatch.delenv("BATCHGEN_INSECURE")
    try:
        file_id = first.upload(lines)["id"]
        batch_id = first.create_batch(file_id)["id"]
        deadline = time.monotonic() + 30
        while first.batch(batch_id)["request_counts"]["completed"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert first.batch(batch_id)["status"] == "in_progress"

        started, resume = threading.Event(), threading.Event()
        answers: list[httpx.Response] = []
        uploader = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    f"{first.base_url}/v1/files",
                    content=slow_upload(started, resume),
                    headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
                    timeout=30,
                )
            )
        )
        uploader.start()
        assert started.wait(10)
        time.sleep(0.3)  # the upload's first bytes are in the server: its request is in flight
        assert process.process is not None
        signalled = time.monotonic()
        os.kill(process.process.pid, signal.SIGTERM)
        time.sleep(0.3)
        resume.set()
        uploader.join(30)
        exit_code = process.process.wait(SHUTDOWN_TIMEOUT_S + 5)
        took = time.monotonic() - signalled
    finally:
        first.http.close()
        process.stop()
    [refused] = answers
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "server_shutting_down" and refused.headers["retry-after"]
    assert exit_code in CLEAN_EXIT_CODES and took < SHUTDOWN_TIMEOUT_S, (exit_code, took)

    second = LiveServer(ServerProcess(tmp_path).start())
    try:
        batch = second.wait(batch_id, timeout_s=60)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
        output = second.lines(batch["output_file_id"])
        assert sorted(line["custom_id"] for line in output) == sorted(line["custom_id"] for line in lines)
        assert batch["usage"]["output_tokens"] == 4 * 2 + 4 * 600
        files = second.http.get("/v1/files", params={"purpose": "batch"}).json()["data"]
        assert [file["id"] for file in files] == [file_id]  # the refused upload left nothing behind
        assert list((tmp_path / "blobs" / ".tmp").iterdir()) == []
        # Results outlive their input file.
        assert second.http.delete(f"/v1/files/{file_id}").json()["deleted"] is True
        assert len(second.lines(batch["output_file_id"])) == 8
        assert second.batch(batch_id)["output_file_id"] == batch["output_file_id"]
    finally:
        second.http.close()
        second.process.stop()
