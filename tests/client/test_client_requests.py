"""Request shape and response parsing of every client method, run against both the sync and the async client."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from batchgen.client import BatchCancelledError, BatchExpiredError, BatchFailedError, BatchWaitTimeoutError
from batchgen.schemas import BatchObject, ChatCompletion, ErrorResponse, FileObject, HealthStatus, PoolStatus

from .conftest import batch_json, error_line, file_json, output_line

JSONL = (
    b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
    b'"body": {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}}\n'
)


def jsonl(*lines: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def multipart_fields(request: httpx.Request) -> dict[str, tuple[str | None, bytes]]:
    """``{name: (filename, content)}`` of a multipart/form-data request."""
    boundary = request.headers["content-type"].split("boundary=")[1].encode()
    fields = {}
    for part in request.content.split(b"--" + boundary)[1:-1]:
        head, _, body = part.removeprefix(b"\r\n").removesuffix(b"\r\n").partition(b"\r\n\r\n")
        disposition = head.decode().split("\r\n")[0]
        name = disposition.split('name="')[1].split('"')[0]
        filename = disposition.split('filename="')[1].split('"')[0] if "filename=" in disposition else None
        fields[name] = (filename, body)
    return fields


def test_common_headers(client: Any, mock: respx.MockRouter) -> None:
    route = mock.get("/v1/models").respond(json={"object": "list", "data": []})
    client.list_models()
    headers = route.calls.last.request.headers
    assert headers["authorization"] == "Bearer sk-test"
    assert headers["user-agent"].startswith("batchgen-client/")
    assert "idempotency-key" not in headers


def test_base_url_and_key_from_environment(make_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen.client import BatchGenHttpClient

    monkeypatch.setenv("BATCHGEN_BASE_URL", "http://env-host:1234/v1/")
    monkeypatch.setenv("BATCHGEN_API_KEY", "sk-env")
    with BatchGenHttpClient() as client:
        assert client.base_url == "http://env-host:1234"
        with respx.mock(base_url="http://env-host:1234") as router:
            route = router.get("/health").respond(json={"status": "healthy"})
            client.health_check()
        assert route.calls.last.request.headers["authorization"] == "Bearer sk-env"
    monkeypatch.delenv("BATCHGEN_BASE_URL")
    assert BatchGenHttpClient(api_key="").base_url == "http://localhost:10900"


def test_health_check(client: Any, mock: respx.MockRouter) -> None:
    mock.get("/health").respond(json={"status": "healthy", "reason": None, "model": "demo"})
    assert client.health_check() == HealthStatus(status="healthy", model="demo")


def test_health_check_unhealthy_is_a_result_not_retried(client: Any, mock: respx.MockRouter) -> None:
    route = mock.get("/health").respond(503, json={"status": "unhealthy", "reason": "engine stopped"})
    assert client.health_check() == HealthStatus(status="unhealthy", reason="engine stopped")
    route.respond(503, json={"error": {"message": "starting", "type": "server_error"}})
    assert client.health_check() == HealthStatus(status="unhealthy", reason="starting")
    assert route.call_count == 2


def test_models(client: Any, mock: respx.MockRouter) -> None:
    model = {"id": "demo", "object": "model", "created": 1, "owned_by": "batchgen", "max_context_length": 512}
    mock.get("/v1/models").respond(json={"object": "list", "data": [model]})
    mock.get("/v1/models/demo").respond(json=model)
    assert [m.id for m in client.list_models().data] == ["demo"]
    assert client.get_model("demo").max_context_length == 512


def test_pool_status(client: Any, mock: respx.MockRouter) -> None:
    pool = {
        "queued_requests": 3,
        "running_requests": 2,
        "capacity": 100,
        "active_batches": 1,
        "kv_blocks_total": 64,
        "kv_blocks_free": 10,
    }
    mock.get("/v1/pool/status").respond(json={"object": "pool.status", **pool})
    assert client.pool_status() == PoolStatus(**pool)


@pytest.mark.parametrize("source", ["path", "bytes", "fileobj"])
def test_upload_file(client: Any, mock: respx.MockRouter, tmp_path: Path, source: str) -> None:
    route = mock.post("/v1/files").respond(json=file_json())
    path = tmp_path / "requests.jsonl"
    path.write_bytes(JSONL)
    if source == "path":
        result = client.upload_file(path)
    elif source == "bytes":
        result = client.upload_file(JSONL, filename="requests.jsonl")
    else:
        with open(path, "rb") as stream:
            result = client.upload_file(stream)
    assert isinstance(result, FileObject) and result.id == "file-abc"
    request = route.calls.last.request
    assert request.headers["content-type"].startswith("multipart/form-data")
    assert request.headers["idempotency-key"].startswith("batchgen-")
    fields = multipart_fields(request)
    assert fields["purpose"] == (None, b"batch")
    assert fields["file"] == ("requests.jsonl", JSONL)


def test_get_and_delete_file(client: Any, mock: respx.MockRouter) -> None:
    mock.get("/v1/files/file-abc").respond(json=file_json())
    delete = mock.delete("/v1/files/file-abc").respond(json={"id": "file-abc", "object": "file", "deleted": True})
    assert client.get_file("file-abc").filename == "requests.jsonl"
    assert client.delete_file("file-abc").deleted is True
    assert delete.called


def test_list_files_follows_every_page(client: Any, mock: respx.MockRouter) -> None:
    pages = {
        None: (["file-1", "file-2"], True),
        "file-2": (["file-3", "file-4"], True),
        "file-4": (["file-5"], False),
    }

    def page(request: httpx.Request) -> httpx.Response:
        ids, more = pages[request.url.params.get("after")]
        data = [file_json(i) for i in ids]
        return httpx.Response(
            200, json={"object": "list", "data": data, "first_id": ids[0], "last_id": ids[-1], "has_more": more}
        )

    route = mock.get("/v1/files").mock(side_effect=page)
    files = client.list_files(purpose="batch", order="asc", page_size=2)
    assert [f.id for f in files] == ["file-1", "file-2", "file-3", "file-4", "file-5"]
    params = [dict(call.request.url.params) for call in route.calls]
    assert params == [
        {"order": "asc", "limit": "2", "purpose": "batch"},
        {"order": "asc", "limit": "2", "purpose": "batch", "after": "file-2"},
        {"order": "asc", "limit": "2", "purpose": "batch", "after": "file-4"},
    ]


def test_list_batches_follows_every_page(client: Any, mock: respx.MockRouter) -> None:
    def page(request: httpx.Request) -> httpx.Response:
        after = request.url.params.get("after")
        ids, more = (["batch_3", "batch_2"], True) if after is None else (["batch_1"], False)
        data = [batch_json(i) for i in ids]
        return httpx.Response(
            200, json={"object": "list", "data": data, "first_id": ids[0], "last_id": ids[-1], "has_more": more}
        )

    route = mock.get("/v1/batches").mock(side_effect=page)
    assert [b.id for b in client.list_batches(page_size=2)] == ["batch_3", "batch_2", "batch_1"]
    assert [dict(call.request.url.params) for call in route.calls] == [
        {"limit": "2"},
        {"limit": "2", "after": "batch_2"},
    ]


def test_download_file_content_and_download_file(client: Any, mock: respx.MockRouter, tmp_path: Path) -> None:
    content = jsonl(output_line("a"), output_line("b")) * 1000
    route = mock.get("/v1/files/file-out/content").respond(
        content=content, headers={"content-type": "application/jsonl"}
    )
    assert client.download_file_content("file-out") == content
    target = tmp_path / "out.jsonl"
    assert client.download_file("file-out", target) == target
    assert target.read_bytes() == content
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]
    assert route.call_count == 2


def test_failed_download_leaves_no_file(make_client: Any, mock: respx.MockRouter, tmp_path: Path) -> None:
    from batchgen.client import NotFoundError

    mock.get("/v1/files/missing/content").respond(
        404,
        json={
            "error": {
                "message": "no such file",
                "type": "invalid_request_error",
                "param": "file_id",
                "code": "not_found",
            }
        },
    )
    with pytest.raises(NotFoundError, match="no such file"):
        make_client().download_file("missing", tmp_path / "out.jsonl")
    assert list(tmp_path.iterdir()) == []


def test_create_batch_sends_every_field(client: Any, mock: respx.MockRouter) -> None:
    route = mock.post("/v1/batches").respond(json=batch_json(max_decoding_length=64))
    batch = client.create_batch(
        "file-abc",
        endpoint="/v1/completions",
        completion_window="24h",
        metadata={"project": "x"},
        max_decoding_length=64,
        max_context_length=256,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
    )
    assert isinstance(batch, BatchObject) and batch.max_decoding_length == 64
    request = route.calls.last.request
    assert request.headers["content-type"] == "application/json"
    assert request.headers["idempotency-key"].startswith("batchgen-")
    assert json.loads(request.content) == {
        "input_file_id": "file-abc",
        "endpoint": "/v1/completions",
        "completion_window": "24h",
        "metadata": {"project": "x"},
        "max_decoding_length": 64,
        "max_context_length": 256,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
    }


def test_create_batch_omits_unset_fields_and_uses_a_new_key_each_time(client: Any, mock: respx.MockRouter) -> None:
    route = mock.post("/v1/batches").respond(json=batch_json())
    client.create_batch("file-abc")
    client.create_batch("file-abc")
    first, second = (call.request for call in route.calls)
    assert json.loads(first.content) == {
        "input_file_id": "file-abc",
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    assert first.headers["idempotency-key"] != second.headers["idempotency-key"]


def test_get_and_cancel_batch(client: Any, mock: respx.MockRouter) -> None:
    mock.get("/v1/batches/batch_abc").respond(json=batch_json(status="in_progress"))
    cancel = mock.post("/v1/batches/batch_abc/cancel").respond(
        json=batch_json(status="cancelled", cancelled_at=1710000005)
    )
    assert client.get_batch("batch_abc").status == "in_progress"
    assert client.cancel_batch("batch_abc").cancelled_at == 1710000005
    assert cancel.calls.last.request.content == b""


def _statuses(mock: respx.MockRouter, *batches: dict[str, Any]) -> respx.Route:
    return mock.get("/v1/batches/batch_abc").mock(side_effect=[httpx.Response(200, json=b) for b in batches])


def test_wait_for_batch_polls_until_completed(client: Any, mock: respx.MockRouter, sleeps: list[float]) -> None:
    route = _statuses(
        mock,
        batch_json(status="validating"),
        batch_json(status="in_progress", request_counts={"total": 2, "completed": 1, "failed": 0}),
        batch_json(
            status="completed", output_file_id="file-out", request_counts={"total": 2, "completed": 2, "failed": 0}
        ),
    )
    seen: list[str] = []
    batch = client.wait_for_batch(
        "batch_abc", poll_interval=0.25, callback=lambda b: seen.append(b.status), progress=False
    )
    assert batch.status == "completed" and batch.output_file_id == "file-out"
    assert seen == ["validating", "in_progress", "completed"]
    assert sleeps == [0.25, 0.25]
    assert route.call_count == 3


@pytest.mark.parametrize(
    ("status", "error"),
    [("failed", BatchFailedError), ("cancelled", BatchCancelledError), ("expired", BatchExpiredError)],
)
def test_wait_for_batch_raises_the_outcome(
    client: Any, mock: respx.MockRouter, status: str, error: type[Exception]
) -> None:
    errors = {
        "object": "list",
        "data": [{"code": "invalid_json", "message": "line is not JSON", "param": None, "line": 3}],
    }
    _statuses(mock, batch_json(status=status, errors=errors if status == "failed" else None))
    with pytest.raises(error) as caught:
        client.wait_for_batch("batch_abc", progress=False)
    assert caught.value.batch.status == status  # type: ignore[attr-defined]
    assert isinstance(caught.value, RuntimeError)
    if status == "failed":
        assert "line 3: line is not JSON" in str(caught.value)


def test_wait_for_batch_timeout(client: Any, mock: respx.MockRouter) -> None:
    _statuses(mock, batch_json(status="in_progress"))
    with pytest.raises(BatchWaitTimeoutError, match="did not finish within 0s") as caught:
        client.wait_for_batch("batch_abc", timeout=0, progress=False)
    assert isinstance(caught.value, TimeoutError)
    assert caught.value.batch.status == "in_progress"


def test_wait_for_batch_progress_bar(client: Any, mock: respx.MockRouter, capsys: pytest.CaptureFixture[str]) -> None:
    _statuses(
        mock,
        batch_json(status="in_progress", request_counts={"total": 4, "completed": 1, "failed": 1}),
        batch_json(status="completed", request_counts={"total": 4, "completed": 3, "failed": 1}),
    )
    client.wait_for_batch("batch_abc", poll_interval=0, progress=True)
    bar = capsys.readouterr().err
    assert "batch_abc" in bar and "4/4" in bar and "req/s" in bar and "failed=1" in bar


def test_submit_batch_from_request_bodies(client: Any, mock: respx.MockRouter, tmp_path: Path) -> None:
    upload = mock.post("/v1/files").respond(json=file_json("file-in"))
    create = mock.post("/v1/batches").respond(json=batch_json(input_file_id="file-in"))
    _statuses(mock, batch_json(status="completed", input_file_id="file-in", output_file_id="file-out"))
    output = jsonl(output_line("request-0"), output_line("request-1"))
    mock.get("/v1/files/file-out/content").respond(content=output)
    bodies = [{"model": "demo", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(2)]

    batch = client.submit_batch(bodies, tmp_path / "out.jsonl", max_decoding_length=16, progress=False)

    assert batch.status == "completed"
    assert (tmp_path / "out.jsonl").read_bytes() == output
    filename, content = multipart_fields(upload.calls.last.request)["file"]
    assert filename == "input.jsonl"
    assert [json.loads(line) for line in content.splitlines()] == [
        {"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i, body in enumerate(bodies)
    ]
    assert json.loads(create.calls.last.request.content)["max_decoding_length"] == 16
    assert json.loads(create.calls.last.request.content)["input_file_id"] == "file-in"


def test_submit_batch_without_waiting(client: Any, mock: respx.MockRouter) -> None:
    mock.post("/v1/files").respond(json=file_json("file-in"))
    mock.post("/v1/batches").respond(json=batch_json())
    polls = mock.get("/v1/batches/batch_abc").respond(json=batch_json())
    lines = [json.loads(JSONL)]
    assert client.submit_batch(lines, wait=False).status == "validating"
    assert not polls.called


def test_iter_results(client: Any, mock: respx.MockRouter) -> None:
    mock.get("/v1/batches/batch_abc").respond(
        json=batch_json(status="completed", output_file_id="file-out", error_file_id="file-err")
    )
    mock.get("/v1/files/file-out/content").respond(content=jsonl(output_line("c", "third"), output_line("a", "first")))
    mock.get("/v1/files/file-err/content").respond(content=jsonl(error_line("b")))
    inputs = [{"custom_id": c, "method": "POST", "url": "/v1/chat/completions", "body": {}} for c in "abc"]
    mock.get("/v1/files/file-abc/content").respond(content=jsonl(*inputs))

    unordered = list(client.iter_results("batch_abc"))
    assert [line.custom_id for line in unordered] == ["c", "a", "b"]
    ordered = list(client.iter_results("batch_abc", in_input_order=True))
    assert [line.custom_id for line in ordered] == ["a", "b", "c"]
    first, failed, third = (line.response.body for line in ordered)
    assert isinstance(first, ChatCompletion) and first.choices[0].message.content == "first"
    assert isinstance(failed, ErrorResponse) and failed.error.code == "context_length_exceeded"
    assert isinstance(third, ChatCompletion)


def test_upload_of_unreadable_path_raises_before_sending(client: Any, mock: respx.MockRouter, tmp_path: Path) -> None:
    route = mock.post("/v1/files").respond(json=file_json())
    with pytest.raises(FileNotFoundError):
        client.upload_file(tmp_path / "missing.jsonl")
    assert not route.called
    assert client.upload_file(io.BytesIO(JSONL)).id == "file-abc"
    assert multipart_fields(route.calls.last.request)["file"] == ("input.jsonl", JSONL)
