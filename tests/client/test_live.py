"""Every client method, the CLI, the compat quick-start and the example against a real server with the demo model.

Uses the ``live_server`` and ``server_factory`` fixtures of ``tests/conftest.py`` (a ``batchgen-server serve`` child
process on a loopback port).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchgen.client import (
    AsyncBatchGenHttpClient,
    AuthenticationError,
    BadRequestError,
    BatchCancelledError,
    BatchFailedError,
    BatchGenHttpClient,
    ConflictError,
    NotFoundError,
    RateLimitError,
)
from batchgen.client.cli import main
from batchgen.schemas import ChatCompletion, ErrorResponse, TextCompletion

from .test_compat import QUICK_START

ROOT = Path(__file__).resolve().parents[2]


def chat(content: str, **body: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **body}


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in lines)


@pytest.fixture
def client(live_server: Any) -> Any:
    with BatchGenHttpClient(live_server.base_url, timeout_s=60) as client:
        yield client


def test_health_models_and_pool(client: BatchGenHttpClient) -> None:
    health = client.health_check()
    assert (health.status, health.model) == ("healthy", "demo")
    models = client.list_models().data
    assert [model.id for model in models] == ["demo"]
    assert client.get_model("demo") == models[0]
    with pytest.raises(NotFoundError) as caught:
        client.get_model("no-such-model")
    assert caught.value.status_code == 404 and caught.value.request_id
    pool = client.pool_status()
    assert pool.capacity > 0 and 0 <= pool.kv_blocks_free <= pool.kv_blocks_total


def test_file_lifecycle(client: BatchGenHttpClient, tmp_path: Path) -> None:
    content = jsonl([line(f"q{i}", chat(f"question {i}")) for i in range(3)])
    path = tmp_path / "questions.jsonl"
    path.write_bytes(content)
    uploaded = [
        client.upload_file(path),
        client.upload_file(content, filename="from-bytes.jsonl"),
        client.upload_file(io.BytesIO(content), filename="from-stream.jsonl"),
    ]
    assert [f.filename for f in uploaded] == ["questions.jsonl", "from-bytes.jsonl", "from-stream.jsonl"]
    assert {f.bytes for f in uploaded} == {len(content)}
    assert len({f.checksum for f in uploaded}) == 1

    assert client.get_file(uploaded[0].id) == uploaded[0]
    # One file per page forces the client through the cursor.
    listed = [f.id for f in client.list_files(purpose="batch", page_size=1)]
    assert set(f.id for f in uploaded) <= set(listed) and len(listed) == len(set(listed))
    ascending = [f.id for f in client.list_files(purpose="batch", order="asc", page_size=2)]
    assert ascending == listed[::-1]

    assert client.download_file_content(uploaded[1].id) == content
    assert client.download_file(uploaded[2].id, tmp_path / "copy.jsonl").read_bytes() == content

    assert client.delete_file(uploaded[0].id).deleted
    with pytest.raises(NotFoundError):
        client.get_file(uploaded[0].id)


def test_invalid_upload_is_a_bad_request(client: BatchGenHttpClient) -> None:
    with pytest.raises(BadRequestError) as caught:
        client.upload_file(b'{"custom_id": "a"\nnot json\n', filename="broken.jsonl")
    assert caught.value.status_code in (400, 422) and caught.value.param == "file" and caught.value.code


class _LoseFirstResponse(httpx.BaseTransport):
    """Delivers the first POST to the server, then drops its response as a broken connection would."""

    def __init__(self) -> None:
        self._inner = httpx.HTTPTransport()
        self.dropped = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        if request.method == "POST" and not self.dropped:
            self.dropped += 1
            response.read()
            raise httpx.ReadError("connection reset after the server answered", request=request)
        return response


def test_retried_creates_do_not_duplicate(live_server: Any) -> None:
    transport = _LoseFirstResponse()
    with (
        httpx.Client(transport=transport) as http,
        BatchGenHttpClient(live_server.base_url, http_client=http, sleep=lambda _: None) as lossy,
        BatchGenHttpClient(live_server.base_url) as client,
    ):
        marker = f"idempotency-{os.getpid()}-{id(transport)}.jsonl"
        uploaded = lossy.upload_file(jsonl([line("a", chat("hi"))]), filename=marker)
        assert transport.dropped == 1
        assert [f.id for f in client.list_files() if f.filename == marker] == [uploaded.id]

        transport.dropped = 0
        before = {b.id for b in client.list_batches()}
        batch = lossy.create_batch(uploaded.id, max_decoding_length=4)
        assert transport.dropped == 1
        assert {b.id for b in client.list_batches()} - before == {batch.id}
        client.wait_for_batch(batch.id, poll_interval=0.05, timeout=60, progress=False)


def test_batch_lifecycle(client: BatchGenHttpClient, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [line(f"q{i}", chat(f"question {i}", max_tokens=None)) for i in range(5)]
    uploaded = client.upload_file(jsonl(lines))
    batch = client.create_batch(
        uploaded.id,
        metadata={"suite": "client-live"},
        max_decoding_length=4,
        max_context_length=256,
        temperature=0.0,
        top_p=0.9,
        top_k=20,
    )
    assert (batch.input_file_id, batch.metadata, batch.max_decoding_length) == (
        uploaded.id,
        {"suite": "client-live"},
        4,
    )
    assert (batch.max_context_length, batch.temperature, batch.top_p, batch.top_k) == (256, 0.0, 0.9, 20)

    seen: list[str] = []
    done = client.wait_for_batch(
        batch.id, poll_interval=0.05, timeout=120, progress=True, callback=lambda b: seen.append(b.status)
    )
    assert done.status == "completed" and seen[-1] == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 5, 0)
    assert "5/5" in capsys.readouterr().err
    assert client.get_batch(batch.id) == done
    assert batch.id in [b.id for b in client.list_batches(page_size=1)]

    results = list(client.iter_results(done, in_input_order=True))
    assert [r.custom_id for r in results] == [f"q{i}" for i in range(5)]
    for result in results:
        assert result.response is not None and isinstance(result.response.body, ChatCompletion)
        # The batch-level max_decoding_length applies to requests that set no max_tokens.
        assert 1 <= result.response.body.usage.completion_tokens <= 4

    with pytest.raises(ConflictError):
        client.cancel_batch(batch.id)


def test_submit_batch_with_request_errors(client: BatchGenHttpClient, tmp_path: Path) -> None:
    bodies = [{"model": "demo", "prompt": f"count {i}", "max_tokens": 3} for i in range(3)]
    bodies.append({"model": "demo", "prompt": "x " * 5000, "max_tokens": 3})
    batch = client.submit_batch(
        bodies, tmp_path / "out.jsonl", endpoint="/v1/completions", poll_interval=0.05, timeout=120, progress=False
    )
    assert batch.status == "completed"
    assert len((tmp_path / "out.jsonl").read_bytes().splitlines()) == batch.request_counts.completed
    results = {r.custom_id: r for r in client.iter_results(batch.id)}
    assert set(results) == {f"request-{i}" for i in range(4)}
    for index in range(3):
        response = results[f"request-{index}"].response
        assert response is not None and isinstance(response.body, TextCompletion)
    too_long = results["request-3"]
    assert batch.request_counts.failed == 1 and batch.error_file_id is not None
    body = too_long.response.body if too_long.response else None
    assert isinstance(body, ErrorResponse) or too_long.error is not None


def test_failed_batch_raises_with_line_errors(client: BatchGenHttpClient) -> None:
    lines = [line("ok", chat("fine")), line("wrong-url", {"model": "demo", "prompt": "hi"}, url="/v1/completions")]
    with pytest.raises(BatchFailedError) as caught:
        client.submit_batch(lines, poll_interval=0.05, timeout=60, progress=False)
    batch = caught.value.batch
    assert batch.status == "failed" and batch.errors is not None
    assert any(error.line == 2 for error in batch.errors.data)


def test_cancel_batch(client: BatchGenHttpClient) -> None:
    lines = [line(f"long{i}", chat("go on", max_tokens=1500, ignore_eos=True)) for i in range(16)]
    batch = client.submit_batch(lines, wait=False)
    cancelled = client.cancel_batch(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    with pytest.raises(BatchCancelledError) as caught:
        client.wait_for_batch(batch.id, poll_interval=0.05, timeout=120, progress=False)
    assert caught.value.batch.cancelled_at is not None
    assert caught.value.batch.request_counts.completed < 16


def test_async_client(live_server: Any) -> None:
    async def scenario() -> None:
        async with AsyncBatchGenHttpClient(live_server.base_url) as client:
            assert (await client.health_check()).status == "healthy"
            assert (await client.get_model("demo")).id == "demo"
            batch = await client.submit_batch(
                [chat(f"async {i}") for i in range(3)], poll_interval=0.05, progress=False
            )
            assert batch.request_counts.completed == 3
            results = [r.custom_id async for r in client.iter_results(batch, in_input_order=True)]
            assert results == ["request-0", "request-1", "request-2"]
            assert batch.id in [b.id async for b in client.list_batches(page_size=2)]
            assert batch.input_file_id in [f.id async for f in client.list_files(page_size=2)]
            assert (await client.pool_status()).capacity > 0

    asyncio.run(scenario())


def test_cli(live_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def cli(*argv: str) -> tuple[int, str, str]:
        code = main(["--base-url", live_server.base_url, *argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl([line(f"c{i}", chat(f"cli {i}")) for i in range(3)]))
    code, out, _ = cli(
        "submit",
        str(source),
        "-o",
        str(target),
        "--max-decoding-length",
        "4",
        "--poll-interval",
        "0.05",
        "--json",
        "--no-progress",
    )
    assert code == 0
    batch = json.loads(out)
    assert batch["status"] == "completed" and batch["max_decoding_length"] == 4
    assert sorted(json.loads(row)["custom_id"] for row in target.read_bytes().splitlines()) == ["c0", "c1", "c2"]

    code, out, _ = cli("status", batch["id"])
    assert code == 0 and "3 completed, 0 failed, 3 total" in out
    assert cli("wait", batch["id"], "--no-progress")[0] == 0
    code, out, _ = cli("download", batch["id"], "-o", str(tmp_path / "again.jsonl"))
    assert code == 0 and (tmp_path / "again.jsonl").read_bytes() == target.read_bytes()
    code, out, _ = cli("list", "batches", "--json")
    assert code == 0 and batch["id"] in [b["id"] for b in json.loads(out)]
    code, out, _ = cli("list", "files", "--limit", "1")
    assert code == 0 and len(out.splitlines()) == 2
    assert cli("models")[1].splitlines()[1].split()[0] == "demo"
    assert cli("health")[:2] == (0, "healthy\n")
    assert cli("pool")[0] == 0
    code, _, err = cli("cancel", batch["id"])
    assert code == 3 and "409" in err
    code, _, err = cli("status", "batch_missing")
    assert code == 3 and "404" in err

    code, out, _ = cli("submit", str(source), "--no-wait", "--json")
    assert code == 0 and json.loads(out)["status"] in ("validating", "in_progress", "completed")


def test_cli_closed_pipe_is_quiet(live_server: Any) -> None:
    """`batchgen list files | head` when head has already exited: no broken-pipe traceback or message."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout now fails with EPIPE
    try:
        result = subprocess.run(
            [sys.executable, "-m", "batchgen.client", "--base-url", live_server.base_url, "list", "files"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")


def test_cli_connection_error(capsys: pytest.CaptureFixture[str]) -> None:
    from batchgen.server.launcher import free_port

    assert main(["--base-url", f"http://127.0.0.1:{free_port()}", "--max-retries", "0", "health"]) == 4


def test_compat_quick_start(
    live_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("requests.jsonl").write_bytes(jsonl([line(f"r{i}", chat(f"compat {i}")) for i in range(2)]))
    exec(QUICK_START, {"BASE_URL": live_server.base_url})
    assert capsys.readouterr().out.startswith("Done: completed, output: file-")
    assert sorted(json.loads(row)["custom_id"] for row in Path("results.jsonl").read_bytes().splitlines()) == [
        "r0",
        "r1",
    ]

    from batchgen.batchgen_client import BatchGenHttpClient as OriginalClient

    original = OriginalClient(live_server.base_url)
    assert original.health_check() is True
    batch = original.create_batch(original.upload_file("requests.jsonl")["id"], max_decoding_length=2)
    finished = original.wait_for_batch(batch["id"], 0.05)
    assert finished["status"] == "completed"
    assert original.get_file(finished["output_file_id"])["purpose"] == "batch_output"
    with pytest.raises(RuntimeError):
        original.get_batch("batch_missing")
    original.close()


def test_notebook_example(
    live_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHGEN_BASE_URL", live_server.base_url)
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(ROOT / "examples" / "notebook_quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "completed BatchRequestCounts(total=4, completed=4, failed=0)" in out
    assert len((tmp_path / "results.jsonl").read_bytes().splitlines()) == 4


def test_auth_and_backpressure(server_factory: Any) -> None:
    server = server_factory("--max-queued-requests", "2", "--retry-after-s", "1", api_key="sk-live")
    with BatchGenHttpClient(server.base_url, api_key="") as anonymous, pytest.raises(AuthenticationError) as caught:
        anonymous.list_models()
    assert caught.value.status_code == 401 and caught.value.request_id

    sleeps: list[float] = []
    with BatchGenHttpClient(server.base_url, api_key="sk-live", max_retries=1, sleep=sleeps.append) as client:
        long = [line(f"l{i}", chat("go on", max_tokens=1500, ignore_eos=True)) for i in range(2)]
        running = client.submit_batch(long, wait=False)
        with pytest.raises(RateLimitError) as limited:
            client.submit_batch([chat("one more")], wait=False)
        assert limited.value.code == "queue_full"
        assert sleeps == [1.0]
        client.cancel_batch(running.id)
        assert next(client.list_batches()).id == running.id
