"""The batch loop through the real server: turns across tenants and batches, the per-request sequence cap, an event
loop that no database lock can stall, and the file routes' smaller faults (non-ASCII names, a missing blob)."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from urllib.parse import quote

import httpx
import pytest
from server_helpers import LiveServer, chat_line, jsonl

TENANT_A, TENANT_B = "key-a", "key-b"


@pytest.fixture(scope="module")
def small_engine(server_factory: Callable[..., LiveServer]) -> LiveServer:
    """Two sequences at a time in the engine (a window of 3), two tenants: turns decide who runs."""
    return server_factory("--max-num-seqs", "2", "--api-key", TENANT_B, api_key=TENANT_A)


def test_a_small_batch_of_another_tenant_finishes_behind_two_huge_ones(small_engine: LiveServer) -> None:
    server = small_engine
    huge = [
        server.create_batch(
            server.upload([chat_line(f"{name}-{i}", max_tokens=20, ignore_eos=True) for i in range(100)])["id"]
        )["id"]
        for name in ("huge-1", "huge-2")
    ]
    other = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {TENANT_B}"}, timeout=30)
    try:
        upload = other.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("small.jsonl", jsonl([chat_line(f"small-{i}", max_tokens=20) for i in range(3)]))},
        )
        small_id = other.post("/v1/batches", json={"input_file_id": upload.json()["id"]}).json()["id"]
        deadline = time.monotonic() + 60
        while (small := other.get(f"/v1/batches/{small_id}").json())["status"] != "completed":
            assert time.monotonic() < deadline, small
            time.sleep(0.05)
        progress = [server.batch(batch_id)["request_counts"]["completed"] for batch_id in huge]
    finally:
        other.close()
        for batch_id in huge:
            server.http.post(f"/v1/batches/{batch_id}/cancel")
    # First come, first served, the small batch would have waited for 200 requests; with turns it ran at once.
    assert sum(progress) < 50, progress
    for batch_id in huge:
        assert server.wait(batch_id, timeout_s=20)["status"] == "cancelled"


def test_a_request_over_the_sequence_cap_gets_an_error_line(live_server: LiveServer) -> None:
    """--max-line-sequences (256 by default) caps one request's prompts x n; the rest of the batch runs."""
    over = {"custom_id": "over", "method": "POST", "url": "/v1/completions"}
    over["body"] = {"model": "demo", "prompt": [f"p{i}" for i in range(130)], "n": 2, "max_tokens": 1}
    fine = {**over, "custom_id": "fine", "body": {**over["body"], "prompt": ["a", "b"]}}
    batch = live_server.run([over, fine], endpoint="/v1/completions")
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    [error] = live_server.lines(batch["error_file_id"])
    assert error["custom_id"] == "over" and error["response"]["status_code"] == 400
    detail = error["response"]["body"]["error"]
    assert detail["code"] == "too_many_sequences" and "260 sequences" in detail["message"]
    [line] = live_server.lines(batch["output_file_id"])
    assert line["custom_id"] == "fine" and len(line["response"]["body"]["choices"]) == 4


def test_a_locked_database_stalls_only_the_requests_that_write(live_server: LiveServer) -> None:
    """Handlers reach the database from worker threads: while another process holds the write lock, an upload
    waits for it, and every other request is still answered (reads go on in SQLite's WAL mode)."""
    batch = live_server.run([chat_line("before-the-lock")])
    lock = sqlite3.connect(live_server.storage_dir / "batchgen.db", isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # the write lock, held by this test until it has its answers
    answers: list[httpx.Response] = []
    upload = threading.Thread(
        target=lambda: answers.append(
            live_server.http.post(
                "/v1/files", data={"purpose": "batch"}, files={"file": ("locked.jsonl", jsonl([chat_line("x")]))}
            )
        )
    )
    try:
        upload.start()
        time.sleep(0.5)
        assert upload.is_alive() and not answers  # waiting for the lock
        with httpx.Client(base_url=live_server.base_url, timeout=10) as http:
            assert http.get("/health").status_code == 200
            assert http.get(f"/v1/batches/{batch['id']}").json()["status"] == "completed"
            assert http.get(f"/v1/files/{batch['output_file_id']}").status_code == 200
            assert http.get("/v1/pool/status").status_code == 200
        assert upload.is_alive(), "the other requests were answered while the upload still waited"
    finally:
        lock.execute("ROLLBACK")
        lock.close()
        upload.join(30)
    assert answers[0].status_code == 200, answers[0].text


@pytest.mark.parametrize("filename", ["文件.jsonl", "😀.jsonl", "résumé «final».jsonl"])
def test_non_ascii_filenames_download(live_server: LiveServer, filename: str) -> None:
    content = jsonl([chat_line("u")])
    file = live_server.upload(content, filename=filename)
    assert file["filename"] == filename
    response = live_server.http.get(f"/v1/files/{file['id']}/content")
    assert response.status_code == 200 and response.content == content
    disposition = response.headers["content-disposition"]  # RFC 6266: ASCII fallback, then the UTF-8 name
    assert disposition.startswith('attachment; filename="') and disposition.isascii()
    assert disposition.endswith(f"; filename*=UTF-8''{quote(filename, safe='')}")


def test_a_missing_blob_is_a_clear_error_before_any_byte(live_server: LiveServer) -> None:
    file = live_server.upload([chat_line("gone")])
    (live_server.storage_dir / "blobs" / file["id"]).unlink()
    response = live_server.http.get(f"/v1/files/{file['id']}/content")
    assert response.status_code == 500
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "file_content_missing")
    assert file["id"] in error["message"]
