"""The ``batchgen`` CLI against a respx-mocked server: output, ``--json`` and exit codes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from batchgen.client.cli import main

from .conftest import BASE, batch_json, file_json, output_line
from .test_client_requests import JSONL, jsonl, multipart_fields


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["--base-url", BASE, "--max-retries", "0", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_status_table_and_json(mock: respx.MockRouter, capsys: pytest.CaptureFixture[str]) -> None:
    counts = {"total": 5, "completed": 3, "failed": 1}
    mock.get("/v1/batches/batch_abc").respond(json=batch_json(status="in_progress", request_counts=counts))

    code, out, _ = run(capsys, "status", "batch_abc")
    assert code == 0
    assert "status          in_progress" in out
    assert "3 completed, 1 failed, 5 total" in out

    code, out, _ = run(capsys, "status", "batch_abc", "--json")
    assert code == 0
    assert json.loads(out)["request_counts"] == counts


def test_submit_waits_and_downloads(mock: respx.MockRouter, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    upload = mock.post("/v1/files").respond(json=file_json("file-in"))
    create = mock.post("/v1/batches").respond(json=batch_json())
    mock.get("/v1/batches/batch_abc").mock(
        side_effect=[
            httpx.Response(200, json=batch_json(status="in_progress")),
            httpx.Response(200, json=batch_json(status="completed", output_file_id="file-out")),
        ]
    )
    mock.get("/v1/files/file-out/content").respond(content=jsonl(output_line("a")))
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(JSONL)

    code, out, _ = run(
        capsys,
        "submit",
        str(source),
        "-o",
        str(target),
        "--max-decoding-length",
        "32",
        "--endpoint",
        "/v1/completions",
        "--metadata",
        "team=nlp",
        "--poll-interval",
        "0",
        "--no-progress",
        "--json",
    )

    assert code == 0
    assert json.loads(out)["status"] == "completed"
    assert json.loads(target.read_bytes())["custom_id"] == "a"
    assert multipart_fields(upload.calls.last.request)["file"] == ("in.jsonl", JSONL)
    body = json.loads(create.calls.last.request.content)
    assert (body["max_decoding_length"], body["endpoint"], body["metadata"]) == (32, "/v1/completions", {"team": "nlp"})


def test_submit_no_wait(mock: respx.MockRouter, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    mock.post("/v1/files").respond(json=file_json("file-in"))
    mock.post("/v1/batches").respond(json=batch_json())
    polls = mock.get("/v1/batches/batch_abc").respond(json=batch_json())
    (tmp_path / "in.jsonl").write_bytes(JSONL)
    code, out, _ = run(capsys, "submit", str(tmp_path / "in.jsonl"), "--no-wait")
    assert code == 0 and "batch_abc" in out and "validating" in out
    assert not polls.called


def test_failed_batch_exits_1(mock: respx.MockRouter, capsys: pytest.CaptureFixture[str]) -> None:
    errors = {"object": "list", "data": [{"code": "invalid_json", "message": "not JSON", "param": None, "line": 2}]}
    mock.get("/v1/batches/batch_abc").respond(json=batch_json(status="failed", errors=errors))
    code, out, err = run(capsys, "wait", "batch_abc", "--no-progress")
    assert code == 1
    assert "line 2: not JSON" in out
    assert "batch batch_abc failed" in err


def test_wait_timeout_exits_5(mock: respx.MockRouter, capsys: pytest.CaptureFixture[str]) -> None:
    mock.get("/v1/batches/batch_abc").respond(json=batch_json(status="in_progress"))
    code, out, err = run(capsys, "wait", "batch_abc", "--timeout", "0", "--no-progress", "--json")
    assert code == 5
    assert json.loads(out)["status"] == "in_progress"
    assert "did not finish" in err


def test_api_error_exits_3(mock: respx.MockRouter, capsys: pytest.CaptureFixture[str]) -> None:
    error = {
        "error": {"message": "batch is completed", "type": "invalid_request_error", "param": None, "code": "conflict"}
    }
    mock.post("/v1/batches/batch_abc/cancel").respond(409, json=error, headers={"x-request-id": "req-9"})
    code, out, err = run(capsys, "cancel", "batch_abc")
    assert (code, out) == (3, "")
    assert "409: batch is completed (code=conflict, request_id=req-9)" in err


def test_connection_error_exits_4(mock: respx.MockRouter, capsys: pytest.CaptureFixture[str]) -> None:
    mock.get("/health").mock(side_effect=httpx.ConnectError("connection refused"))
    code, _, err = run(capsys, "health")
    assert code == 4 and "connection refused" in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["frobnicate"])
    assert caught.value.code == 2
    code, _, err = run(capsys, "submit", str(tmp_path / "in.jsonl"), "--metadata", "novalue")
    assert code == 2 and "KEY=VALUE" in err
    code, _, err = run(capsys, "submit", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "missing.jsonl" in err


def test_health(mock: respx.MockRouter, capsys: pytest.CaptureFixture[str]) -> None:
    route = mock.get("/health").respond(json={"status": "healthy"})
    assert run(capsys, "health")[:2] == (0, "healthy\n")
    route.respond(503, json={"status": "unhealthy", "reason": "model not loaded"})
    assert run(capsys, "health")[:2] == (1, "unhealthy: model not loaded\n")


def test_list_batches_and_files(mock: respx.MockRouter, capsys: pytest.CaptureFixture[str]) -> None:
    batches = [batch_json(f"batch_{i}", status="completed") for i in range(3)]
    mock.get("/v1/batches").respond(json={"object": "list", "data": batches, "has_more": False})
    mock.get("/v1/files").respond(
        json={"object": "list", "data": [file_json("file-1"), file_json("file-2")], "has_more": False}
    )

    code, out, _ = run(capsys, "list", "batches", "--limit", "2")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["id", "status", "endpoint", "done/failed/total", "created"]
    assert [line.split()[0] for line in lines[1:]] == ["batch_0", "batch_1"]

    code, out, _ = run(capsys, "list", "files", "--json")
    assert [f["id"] for f in json.loads(out)] == ["file-1", "file-2"]


def test_models_and_pool(mock: respx.MockRouter, capsys: pytest.CaptureFixture[str]) -> None:
    model = {"id": "demo", "object": "model", "created": 1, "owned_by": "batchgen", "max_context_length": 512}
    mock.get("/v1/models").respond(json={"object": "list", "data": [model]})
    pool = {"queued_requests": 0, "running_requests": 1, "capacity": 64, "active_batches": 1}
    mock.get("/v1/pool/status").respond(json={**pool, "kv_blocks_total": 8, "kv_blocks_free": 7})
    code, out, _ = run(capsys, "models")
    assert code == 0 and out.splitlines()[1].split() == ["demo", "512", "batchgen"]
    code, out, _ = run(capsys, "pool")
    assert code == 0 and ["kv_blocks_free", "7"] in [line.split() for line in out.splitlines()]


def test_download_batch_output_and_errors(
    mock: respx.MockRouter, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    route = mock.get("/v1/batches/batch_abc").respond(json=batch_json(status="completed", output_file_id="file-out"))
    mock.get("/v1/files/file-out/content").respond(content=b"results\n")
    code, out, _ = run(capsys, "download", "batch_abc", "-o", str(tmp_path / "out.jsonl"))
    assert code == 0 and "file-out: 8 bytes" in out
    assert (tmp_path / "out.jsonl").read_bytes() == b"results\n"

    code, _, err = run(capsys, "download", "batch_abc", "--errors", "-o", str(tmp_path / "err.jsonl"))
    assert code == 1 and "has no error file" in err
    assert route.call_count == 2

    code, out, _ = run(capsys, "download", "file-out", "-o", str(tmp_path / "again.jsonl"), "--json")
    assert code == 0
    assert json.loads(out) == {"file_id": "file-out", "path": str(tmp_path / "again.jsonl"), "bytes": 8}


def test_options_after_the_command_override_defaults_only(
    mock: respx.MockRouter, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    monkeypatch.setenv("BATCHGEN_API_KEY", "sk-env")
    route = mock.get("/health").respond(json={"status": "healthy"})
    assert main(["--json", "health", "--base-url", BASE, "--api-key", "sk-cli"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "healthy"
    assert route.calls.last.request.headers["authorization"] == "Bearer sk-cli"
