"""The ``batchgen`` CLI against a respx-mocked server: output, ``--json`` and exit codes."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from batchgen.client.cli import MAX_SHOWN_ERRORS, main
from batchgen.schemas import GenerationDefaults

from .conftest import BASE, batch_json, file_json, output_line
from .test_client_requests import JSONL, jsonl, multipart_fields

COMPLETIONS = jsonl(
    {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "demo", "prompt": "hi"}}
)


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
    source.write_bytes(COMPLETIONS)

    code, out, _ = run(
        capsys,
        "submit",
        str(source),
        "-o",
        str(target),
        "--max-decoding-length",
        "32",
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
    assert multipart_fields(upload.calls.last.request)["file"] == ("in.jsonl", COMPLETIONS)
    body = json.loads(create.calls.last.request.content)
    # The endpoint comes from the lines' url: no --endpoint needed for a completions file.
    assert (body["max_decoding_length"], body["endpoint"], body["metadata"]) == (32, "/v1/completions", {"team": "nlp"})


def test_submit_shows_every_invalid_line_up_to_a_limit_and_uploads_nothing(
    mock: respx.MockRouter, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    upload = mock.post("/v1/files").respond(json=file_json("file-in"))
    good = json.loads(JSONL)
    bad = [{**good, "custom_id": f"bad-{i}", "body": {"model": "demo"}} for i in range(MAX_SHOWN_ERRORS + 5)]
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(good, *bad))

    code, out, err = run(capsys, "submit", str(source))
    assert (code, out) == (6, "")
    lines = err.splitlines()
    assert (
        lines[0]
        == f"batchgen: {source}: {MAX_SHOWN_ERRORS + 5} error(s) in {len(bad) + 1} request(s); nothing was uploaded"
    )
    assert lines[1].startswith("  line 2: Missing required parameter: 'body.messages'")
    assert lines[MAX_SHOWN_ERRORS].startswith(f"  line {MAX_SHOWN_ERRORS + 1}: ")
    assert lines[-1] == "  ... and 5 more" and len(lines) == MAX_SHOWN_ERRORS + 2

    code, _, err = run(capsys, "submit", str(source), "--json")
    error = json.loads(err)["error"]
    assert (code, error["code"], error["error_count"], len(error["errors"])) == (
        6,
        "invalid_input_file",
        MAX_SHOWN_ERRORS + 5,
        MAX_SHOWN_ERRORS,
    )
    assert error["errors"][0] == {
        "line": 2,
        "code": "missing_required_parameter",
        "message": "Missing required parameter: 'body.messages'.",
        "param": "body.messages",
    }

    # An explicit --endpoint is checked against every line.
    source.write_bytes(JSONL)
    code, _, err = run(capsys, "submit", str(source), "--endpoint", "/v1/completions")
    assert code == 6 and "line 1: The url '/v1/chat/completions' does not match" in err
    assert not upload.called


def test_generation_options_follow_the_schema(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(JSONL)
    with pytest.raises(SystemExit) as caught:
        main(["submit", str(source), "--top-p", "0"])
    assert caught.value.code == 2
    assert "argument --top-p: '0': Expected `float` > 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["submit", str(source), "--top-k", "many", "--json"])
    error = json.loads(capsys.readouterr().err)["error"]
    assert error["type"] == "usage_error" and error["message"].startswith("argument --top-k: 'many': Expected `int")

    with pytest.raises(SystemExit):
        main(["submit", "--help"])
    help = " ".join(capsys.readouterr().out.split())
    assert all(f"--{name.replace('_', '-')} " in help for name in GenerationDefaults.__struct_fields__)
    assert "--top-k N sample among the k likeliest tokens (0 or -1: all)" in help


def test_submit_no_wait(mock: respx.MockRouter, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    mock.post("/v1/files").respond(json=file_json("file-in"))
    mock.post("/v1/batches").respond(json=batch_json())
    polls = mock.get("/v1/batches/batch_abc").respond(json=batch_json())
    (tmp_path / "in.jsonl").write_bytes(JSONL)
    code, out, _ = run(capsys, "submit", str(tmp_path / "in.jsonl"), "--no-wait")
    assert code == 0 and "batch_abc" in out and "validating" in out
    assert not polls.called


def test_failed_batch_exits_1_showing_its_errors_up_to_a_limit(
    mock: respx.MockRouter, capsys: pytest.CaptureFixture[str]
) -> None:
    data = [{"code": "invalid_json", "message": "not JSON", "param": None, "line": line} for line in range(2, 28)]
    mock.get("/v1/batches/batch_abc").respond(json=batch_json(status="failed", errors={"object": "list", "data": data}))
    code, out, err = run(capsys, "wait", "batch_abc", "--no-progress")
    assert code == 1
    errors = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith("error ")]
    assert errors[0] == "line 2: not JSON (invalid_json)" and len(errors) == MAX_SHOWN_ERRORS + 1
    assert errors[-1] == f"... and {len(data) - MAX_SHOWN_ERRORS} more ({len(data)} reported)"
    assert err == "batchgen: batch batch_abc failed\n"

    code, out, err = run(capsys, "wait", "batch_abc", "--no-progress", "--json")
    assert (code, len(json.loads(out)["errors"]["data"])) == (1, len(data))
    error = {"message": "batch batch_abc failed", "type": "batch_error", "param": None, "code": "failed"}
    assert json.loads(err) == {"error": error}


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

    code, out, err = run(capsys, "cancel", "batch_abc", "--json")
    assert (code, out) == (3, "")
    assert json.loads(err) == {"error": {**error["error"], "status_code": 409, "request_id": "req-9"}}


def test_connection_error_exits_4(mock: respx.MockRouter, capsys: pytest.CaptureFixture[str]) -> None:
    route = mock.get("/health").mock(side_effect=httpx.ConnectError("connection refused"))
    code, _, err = run(capsys, "health")
    assert code == 4 and "connection refused" in err
    route.mock(side_effect=httpx.ReadTimeout("slow"))
    code, _, err = run(capsys, "health", "--json")
    error = json.loads(err)["error"]
    assert (code, error["type"], error["code"]) == (4, "connection_error", "timeout")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out == f"batchgen {importlib.metadata.version('batchgen-client')}\n"


def test_files_delete(mock: respx.MockRouter, capsys: pytest.CaptureFixture[str]) -> None:
    route = mock.delete("/v1/files/file-1").respond(json={"id": "file-1", "object": "file", "deleted": True})
    assert run(capsys, "files", "delete", "file-1")[:2] == (0, "file-1 deleted\n")
    code, out, _ = run(capsys, "files", "delete", "file-1", "--json")
    assert (code, json.loads(out)) == (0, {"id": "file-1", "object": "file", "deleted": True})
    assert route.call_count == 2


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
    assert (code, err) == (1, "batchgen: batch batch_abc is completed and no request failed, so it has no error file\n")
    assert route.call_count == 2

    code, out, _ = run(capsys, "download", "file-out", "-o", str(tmp_path / "again.jsonl"), "--json")
    assert code == 0
    assert json.loads(out) == {"file_id": "file-out", "path": str(tmp_path / "again.jsonl"), "bytes": 8}


@pytest.mark.parametrize(
    ("batch", "why"),
    [
        ({"status": "validating"}, "is validating: its output file does not exist yet"),
        ({"status": "failed"}, "failed before running any request, so it has no output file"),
        (
            {"status": "cancelled", "in_progress_at": 1},
            "is cancelled and no request succeeded, so it has no output file",
        ),
    ],
)
def test_download_says_why_a_batch_has_no_file(
    mock: respx.MockRouter, capsys: pytest.CaptureFixture[str], tmp_path: Path, batch: dict[str, Any], why: str
) -> None:
    mock.get("/v1/batches/batch_abc").respond(json=batch_json(**batch))
    code, _, err = run(capsys, "download", "batch_abc", "-o", str(tmp_path / "out.jsonl"), "--json")
    error = json.loads(err)["error"]
    assert (code, error["message"], error["code"]) == (1, f"batch batch_abc {why}", "no_output_file")
    assert not (tmp_path / "out.jsonl").exists()


def test_options_after_the_command_override_defaults_only(
    mock: respx.MockRouter, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    monkeypatch.setenv("BATCHGEN_API_KEY", "sk-env")
    route = mock.get("/health").respond(json={"status": "healthy"})
    assert main(["--json", "health", "--base-url", BASE, "--api-key", "sk-cli"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "healthy"
    assert route.calls.last.request.headers["authorization"] == "Bearer sk-cli"
