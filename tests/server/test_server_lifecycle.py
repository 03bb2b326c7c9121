"""Raw HTTP through the whole lifecycle: every field of every object, output and error files line by line."""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

from server_helpers import LiveServer, chat_line, jsonl

BATCH_FIELDS = {
    "id",
    "object",
    "endpoint",
    "model",
    "errors",
    "input_file_id",
    "completion_window",
    "status",
    "output_file_id",
    "error_file_id",
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
    "request_counts",
    "usage",
    "metadata",
    "max_decoding_length",
    "max_context_length",
    "temperature",
    "top_p",
    "top_k",
    "response_format",
}


def test_file_object_and_content(live_server: LiveServer) -> None:
    content = jsonl([chat_line("a"), chat_line("b")])
    before = int(time.time())
    response = live_server.http.post(
        "/v1/files",
        data={"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"},
        files={"file": ("../../etc/myinput.jsonl", content)},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"]
    file = response.json()
    assert set(file) == {
        "id",
        "object",
        "bytes",
        "created_at",
        "filename",
        "purpose",
        "status",
        "status_details",
        "expires_at",
        "checksum",
    }
    assert re.fullmatch(r"file-[0-9a-f]{24}", file["id"])
    assert before <= file["created_at"] <= int(time.time())
    assert file == {
        "id": file["id"],
        "object": "file",
        "bytes": len(content),
        "created_at": file["created_at"],
        "filename": "myinput.jsonl",  # the directories are stripped
        "purpose": "batch",
        "status": "processed",
        "status_details": None,
        "expires_at": file["created_at"] + 3600,
        "checksum": f"sha256:{hashlib.sha256(content).hexdigest()}",
    }
    assert live_server.http.get(f"/v1/files/{file['id']}").json() == file
    download = live_server.http.get(f"/v1/files/{file['id']}/content")
    assert download.content == content
    assert download.headers["content-disposition"] == 'attachment; filename="myinput.jsonl"'


def test_batch_object_output_and_error_files(live_server: LiveServer) -> None:
    lines = [
        chat_line("good-1", "Tell me a story."),
        chat_line("two-choices", "Pick two.", n=2, max_tokens=4),
        chat_line("too-long", "x" * 2100),  # over the demo model's 2048-token context: an error line, not a failure
        {**chat_line("good-2", "Another one."), "body": {**chat_line("")["body"], "max_tokens": 3, "ignore_eos": True}},
    ]
    file_id = live_server.upload(lines)["id"]
    created = live_server.create_batch(file_id, metadata={"team": "qa"}, top_k=5)
    assert set(created) == BATCH_FIELDS
    assert re.fullmatch(r"batch_[0-9a-f]{24}", created["id"])
    assert created["status"] == "validating" and created["request_counts"]["total"] == 4
    batch = live_server.wait(created["id"])

    assert set(batch) == BATCH_FIELDS
    assert batch["status"] == "completed", batch
    assert batch["object"] == "batch" and batch["model"] == "demo" and batch["errors"] is None
    assert (batch["endpoint"], batch["input_file_id"], batch["completion_window"]) == (
        "/v1/chat/completions",
        file_id,
        "24h",
    )
    assert batch["created_at"] <= batch["in_progress_at"] <= batch["finalizing_at"] <= batch["completed_at"]
    assert batch["expires_at"] == batch["created_at"] + 86400
    assert batch["failed_at"] is batch["expired_at"] is batch["cancelling_at"] is batch["cancelled_at"] is None
    assert batch["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert (batch["metadata"], batch["top_k"], batch["temperature"], batch["max_decoding_length"]) == (
        {"team": "qa"},
        5,
        None,
        None,
    )

    output = live_server.lines(batch["output_file_id"])
    by_id = {line["custom_id"]: line for line in output}
    assert sorted(by_id) == ["good-1", "good-2", "two-choices"]
    for line in output:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert re.fullmatch(r"batch_req_[0-9a-f]{32}", line["id"])
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == "demo"
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert [choice["index"] for choice in by_id["two-choices"]["response"]["body"]["choices"]] == [0, 1]
    good_2 = by_id["good-2"]["response"]["body"]
    assert good_2["usage"]["completion_tokens"] == 3 and good_2["choices"][0]["finish_reason"] == "length"

    usage = batch["usage"]
    bodies = [line["response"]["body"] for line in output]
    assert usage["input_tokens"] == sum(body["usage"]["prompt_tokens"] for body in bodies)
    assert usage["output_tokens"] == sum(body["usage"]["completion_tokens"] for body in bodies)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"] == {"cached_tokens": usage["input_tokens_details"]["cached_tokens"]}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}

    [error_line] = live_server.lines(batch["error_file_id"])
    assert error_line["custom_id"] == "too-long" and error_line["error"] is None
    assert error_line["response"]["status_code"] == 400
    assert error_line["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert error_line["response"]["body"]["error"]["type"] == "invalid_request_error"

    for file_id, kind in ((batch["output_file_id"], "output"), (batch["error_file_id"], "error")):
        file = live_server.http.get(f"/v1/files/{file_id}").json()
        content = live_server.http.get(f"/v1/files/{file_id}/content").content
        assert (file["purpose"], file["status"], file["bytes"]) == ("batch_output", "processed", len(content))
        assert file["filename"] == f"{batch['id']}_{kind}.jsonl"
        assert file["checksum"] == f"sha256:{hashlib.sha256(content).hexdigest()}"


def test_all_requests_failing_completes_without_output(live_server: LiveServer) -> None:
    batch = live_server.run([chat_line(f"long-{i}", "y" * 2100) for i in range(2)])
    assert batch["status"] == "completed"
    assert batch["output_file_id"] is None and batch["error_file_id"] is not None
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    assert sorted(line["custom_id"] for line in live_server.lines(batch["error_file_id"])) == ["long-0", "long-1"]


def test_validation_failure_lists_lines_and_codes(live_server: LiveServer) -> None:
    good = jsonl([chat_line("a")])
    duplicate = jsonl([chat_line("a")])
    wrong_url = jsonl([{**chat_line("c"), "url": "/v1/completions"}])
    missing = jsonl([{"custom_id": "d", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "demo"}}])
    file_id = live_server.upload(good + duplicate + wrong_url + missing)["id"]
    batch = live_server.wait(live_server.create_batch(file_id)["id"])
    assert batch["status"] == "failed" and batch["failed_at"] is not None
    assert batch["in_progress_at"] is None and batch["output_file_id"] is None and batch["error_file_id"] is None
    assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    errors = batch["errors"]
    assert errors["object"] == "list"
    assert [(e["line"], e["code"], e["param"]) for e in errors["data"]] == [
        (2, "duplicate_custom_id", "custom_id"),
        (3, "invalid_url", "url"),
        (4, "missing_required_parameter", "body.messages"),
    ]
    assert all(e["message"] for e in errors["data"])


def test_batch_defaults_apply_where_requests_set_none(live_server: LiveServer) -> None:
    unset = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    lines = [
        {"custom_id": "default", "method": "POST", "url": "/v1/chat/completions", "body": unset},
        {"custom_id": "own", "method": "POST", "url": "/v1/chat/completions", "body": {**unset, "max_tokens": 5}},
        chat_line("over-context", "z" * 60),
    ]
    batch = live_server.run(lines, max_decoding_length=3, max_context_length=40, temperature=0.7, top_p=0.9)
    assert (batch["max_decoding_length"], batch["max_context_length"], batch["temperature"], batch["top_p"]) == (
        3,
        40,
        0.7,
        0.9,
    )
    tokens = {
        line["custom_id"]: line["response"]["body"]["usage"]["completion_tokens"]
        for line in live_server.lines(batch["output_file_id"])
    }
    assert tokens == {"default": 3, "own": 5}
    [error] = live_server.lines(batch["error_file_id"])
    assert error["custom_id"] == "over-context"
    assert error["response"]["body"]["error"]["code"] == "context_length_exceeded"


def test_completions_and_embeddings(live_server: LiveServer) -> None:
    completion = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "demo", "prompt": ["Once", "Twice"], "max_tokens": 4},
    }
    batch = live_server.run([completion], endpoint="/v1/completions")
    [line] = live_server.lines(batch["output_file_id"])
    body = line["response"]["body"]
    assert body["object"] == "text_completion" and [c["index"] for c in body["choices"]] == [0, 1]

    embedding = {
        "custom_id": "e",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "demo", "input": ["first text", "second text"]},
    }
    batch = live_server.run([embedding], endpoint="/v1/embeddings")
    [line] = live_server.lines(batch["output_file_id"])
    body = line["response"]["body"]
    assert body["object"] == "list" and [item["index"] for item in body["data"]] == [0, 1]
    assert all(isinstance(x, float) for x in body["data"][0]["embedding"])
    assert batch["usage"]["input_tokens"] == body["usage"]["prompt_tokens"] > 0


def _wait_for(predicate: Any, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_partial_output_then_cancel_keeps_finished_results(live_server: LiveServer) -> None:
    short = [chat_line(f"short-{i}", max_tokens=2, ignore_eos=True) for i in range(3)]
    long = [chat_line(f"long-{i}", max_tokens=2000, ignore_eos=True) for i in range(4)]
    input_file = live_server.upload(short + long)["id"]
    batch_id = live_server.create_batch(input_file)["id"]
    _wait_for(lambda: live_server.batch(batch_id)["request_counts"]["completed"] >= 3)

    running = live_server.batch(batch_id)
    assert running["status"] == "in_progress" and running["in_progress_at"] is not None
    partial = live_server.lines(running["output_file_id"])
    assert {line["custom_id"] for line in partial} >= {"short-0", "short-1", "short-2"}
    output_file = live_server.http.get(f"/v1/files/{running['output_file_id']}").json()
    assert output_file["status"] == "uploaded"  # still being written
    in_use = live_server.http.delete(f"/v1/files/{input_file}")
    assert (in_use.status_code, in_use.json()["error"]["code"]) == (409, "file_in_use")

    cancel = live_server.http.post(f"/v1/batches/{batch_id}/cancel")
    assert cancel.status_code == 200 and cancel.json()["status"] in {"cancelling", "cancelled"}
    cancelled = live_server.wait(batch_id, timeout_s=20)
    assert cancelled["status"] == "cancelled"
    assert cancelled["cancelling_at"] <= cancelled["cancelled_at"] and cancelled["completed_at"] is None
    kept = live_server.lines(cancelled["output_file_id"])
    assert {line["custom_id"] for line in kept} >= {"short-0", "short-1", "short-2"}
    assert cancelled["request_counts"]["completed"] == len(kept) < 7
    assert cancelled["error_file_id"] is None  # nothing failed: the empty error file is dropped
    assert live_server.http.post(f"/v1/batches/{batch_id}/cancel").json() == cancelled
    assert live_server.http.delete(f"/v1/files/{input_file}").json()["deleted"] is True


def test_batches_run_side_by_side(live_server: LiveServer) -> None:
    big = live_server.create_batch(
        live_server.upload([chat_line(f"big-{i}", max_tokens=300, ignore_eos=True) for i in range(6)])["id"]
    )
    small = live_server.create_batch(live_server.upload([chat_line("small", max_tokens=2)])["id"])
    small_done = live_server.wait(small["id"])
    big_done = live_server.wait(big["id"])
    assert small_done["status"] == big_done["status"] == "completed"
    assert big_done["request_counts"]["completed"] == 6
    # The small batch started while the big one was still running: batches share the engine.
    assert small_done["in_progress_at"] <= big_done["completed_at"]


def test_idempotency_keys(live_server: LiveServer) -> None:
    content = jsonl([chat_line("idem")])
    headers = {"Idempotency-Key": f"upload-{time.time_ns()}"}
    first = live_server.http.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", content)}, headers=headers
    )
    again = live_server.http.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", content)}, headers=headers
    )
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    listed = [file["id"] for file in live_server.http.get("/v1/files").json()["data"]]
    assert listed.count(first.json()["id"]) == 1

    key = {"Idempotency-Key": f"batch-{time.time_ns()}"}
    body = {"input_file_id": first.json()["id"]}
    one = live_server.http.post("/v1/batches", json=body, headers=key).json()
    two = live_server.http.post("/v1/batches", json=body, headers=key).json()
    other = live_server.http.post("/v1/batches", json=body, headers={"Idempotency-Key": "another"}).json()
    assert one["id"] == two["id"] != other["id"]
    live_server.wait(one["id"])
    live_server.wait(other["id"])


def test_operations_endpoints(live_server: LiveServer) -> None:
    health = live_server.http.get("/health")
    # One engine, no replicas; the tests' 64 MiB float32 cache (BATCHGEN_CPU_KV_CACHE_GIB) in blocks of 16 tokens.
    cache = {"dtype": "float32", "tokens": 131_072, "blocks": 8192, "bytes": 64 * 2**20}
    cache |= {"state_slots": 0, "state_checkpoints": 0, "state_bytes_per_sequence": 0, "state_bytes": 0}  # no state
    healthy = {"status": "healthy", "reason": None, "model": "demo", "kv_cache": cache, "replicas": None}
    assert (health.status_code, health.json()) == (200, healthy)
    pool = live_server.http.get("/v1/pool/status").json()
    assert pool["object"] == "pool.status" and pool["capacity"] == 100_000 and pool["replicas"] is None
    assert pool["kv_blocks_total"] >= pool["kv_blocks_free"] > 0
    assert {"queued_requests", "running_requests", "active_batches"} <= set(pool)
    assert live_server.http.get("/metrics").status_code == 200  # its families: test_metrics_and_logs.py
    schema = live_server.http.get("/schema/openapi.json").json()
    assert {"/v1/files", "/v1/batches", "/v1/batches/{batch_id}/cancel", "/health"} <= set(schema["paths"])
    assert live_server.http.get("/schema/swagger").status_code == 200
