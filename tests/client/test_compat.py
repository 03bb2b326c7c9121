"""``batchgen.batchgen_client``: the original client's documented quick-start and signatures, unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from .conftest import BASE, batch_json, file_json, output_line
from .test_client_requests import JSONL, jsonl, multipart_fields

QUICK_START = """
from batchgen.batchgen_client import BatchGenHttpClient

client = BatchGenHttpClient(base_url=BASE_URL)

# One-liner: upload, run, wait, download
batch = client.submit_batch(
    input_file_path="requests.jsonl",
    output_file_path="results.jsonl",
    max_decoding_length=1024,
)
print(f"Done: {batch['status']}, output: {batch['output_file_id']}")
client.close()
"""


@pytest.fixture
def mock() -> Any:
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        yield router


def test_documented_quick_start_runs_unchanged(
    mock: respx.MockRouter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    upload = mock.post("/v1/files").respond(json=file_json("file-in"))
    create = mock.post("/v1/batches").respond(json=batch_json(input_file_id="file-in"))
    mock.get("/v1/batches/batch_abc").respond(json=batch_json(status="completed", output_file_id="file-out"))
    results = jsonl(output_line("a"))
    mock.get("/v1/files/file-out/content").respond(content=results)
    monkeypatch.chdir(tmp_path)
    Path("requests.jsonl").write_bytes(JSONL)

    exec(QUICK_START, {"BASE_URL": BASE})

    assert capsys.readouterr().out == "Done: completed, output: file-out\n"
    assert Path("results.jsonl").read_bytes() == results
    assert multipart_fields(upload.calls.last.request)["file"] == ("requests.jsonl", JSONL)
    assert json.loads(create.calls.last.request.content)["max_decoding_length"] == 1024


def test_original_methods_return_plain_dicts(mock: respx.MockRouter, tmp_path: Path) -> None:
    from batchgen.batchgen_client import BatchGenHttpClient

    mock.get("/health").respond(json={"status": "healthy"})
    mock.post("/v1/files").respond(json=file_json())
    mock.get("/v1/files/file-abc").respond(json=file_json())
    create = mock.post("/v1/batches").respond(json=batch_json(metadata={"k": "v"}))
    mock.get("/v1/batches/batch_abc").respond(json=batch_json(status="completed", output_file_id="file-out"))
    mock.get("/v1/files/file-out/content").respond(content=b"out\n")
    (tmp_path / "in.jsonl").write_bytes(JSONL)

    with BatchGenHttpClient(BASE, timeout_s=None) as client:
        assert client.health_check() is True
        uploaded = client.upload_file(str(tmp_path / "in.jsonl"), purpose="batch")
        assert type(uploaded) is dict and uploaded["id"] == "file-abc"
        assert client.get_file("file-abc") == uploaded
        batch = client.create_batch("file-abc", "/v1/completions", "24h", {"k": "v"}, 8, None, 0.0, None, 5)
        assert batch["metadata"] == {"k": "v"} and batch["request_counts"]["total"] == 2
        body = json.loads(create.calls.last.request.content)
        assert (body["endpoint"], body["temperature"], body["top_k"]) == ("/v1/completions", 0.0, 5)
        assert client.get_batch("batch_abc")["status"] == "completed"
        assert client.wait_for_batch("batch_abc", 0.01, None)["output_file_id"] == "file-out"
        assert client.download_file_content("file-out") == b"out\n"


def test_health_check_is_false_when_unreachable_or_unhealthy(mock: respx.MockRouter) -> None:
    from batchgen.batchgen_client import BatchGenHttpClient

    route = mock.get("/health").mock(side_effect=httpx.ConnectError("refused"))
    client = BatchGenHttpClient(BASE)
    assert client.health_check() is False
    route.mock(side_effect=None).respond(503, json={"status": "unhealthy"})
    assert client.health_check() is False


@pytest.mark.parametrize("status", ["failed", "cancelled"])
def test_wait_for_batch_raises_runtime_error(mock: respx.MockRouter, status: str) -> None:
    from batchgen.batchgen_client import BatchGenHttpClient

    mock.get("/v1/batches/batch_abc").respond(json=batch_json(status=status))
    with pytest.raises(RuntimeError, match=f"batch batch_abc {status}"):
        BatchGenHttpClient(BASE).wait_for_batch("batch_abc")


def test_wait_for_batch_raises_timeout_error(mock: respx.MockRouter) -> None:
    from batchgen.batchgen_client import BatchGenHttpClient

    route = mock.get("/v1/batches/batch_abc").respond(json=batch_json(status="in_progress"))
    with pytest.raises(TimeoutError, match=r"did not finish within 0\.05s"):
        BatchGenHttpClient(BASE).wait_for_batch("batch_abc", poll_interval=0.01, timeout=0.05)
    assert route.call_count >= 2


def test_http_errors_are_runtime_errors(mock: respx.MockRouter) -> None:
    from batchgen.batchgen_client import BatchGenHttpClient

    error = {"error": {"message": "no such batch", "type": "invalid_request_error", "param": None, "code": None}}
    mock.get("/v1/batches/nope").respond(404, json=error)
    with pytest.raises(RuntimeError, match="404: no such batch"):
        BatchGenHttpClient(BASE).get_batch("nope")
