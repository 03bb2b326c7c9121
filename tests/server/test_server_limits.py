"""A server with API keys, a small queue capacity, a small upload limit, a short upload idle timeout and callbacks
allowed to 127.0.0.1: 401 on every /v1 route, 404 across tenants (list cursors included), 413, 408, metadata limits,
filenames, ids, 429 and capacity in sequences, the completion callback; a server with a fast clock: batch expiry and
file expiry.

The other input limits (requests per file, line length, JSON nesting depth) are checked over HTTP with the malformed
corpus in tests/fuzz/test_corpus_api.py."""

from __future__ import annotations

import json
import socket
import sqlite3
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from server_helpers import LiveServer, Receiver, Reply, chat_line, jsonl

KEY, OTHER_KEY = "key-one", "key-two"


@pytest.fixture(scope="module")
def server(server_factory: Callable[..., LiveServer]) -> LiveServer:
    return server_factory(
        "--max-queued-requests",
        "10",
        "--max-upload-bytes",
        "4096",
        "--api-key",
        OTHER_KEY,
        "--callback-allowed-host",
        "127.0.0.1",
        "--upload-idle-timeout-s",
        "1",
        api_key=KEY,
    )


def assert_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert (error["code"], error["param"]) == (code, param), error


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("GET", "/v1/files"),
        ("POST", "/v1/files"),
        ("GET", "/v1/batches"),
        ("POST", "/v1/batches"),
        ("GET", "/v1/batches/batch_x"),
        ("POST", "/v1/batches/batch_x/cancel"),
        ("GET", "/v1/files/file-x"),
        ("DELETE", "/v1/files/file-x"),
        ("GET", "/v1/files/file-x/content"),
        ("GET", "/v1/pool/status"),
        ("POST", "/v1/inference"),
        # No such route: still 401, so a caller without a key learns nothing about what exists.
        ("GET", "/v1/secrets"),
        ("DELETE", "/v1/batches/batch_x"),
        ("GET", "/v1/files/..%2F..%2Fetc%2Fpasswd"),
    ],
)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Basic {KEY}"])
def test_v1_needs_a_valid_key(server: LiveServer, method: str, path: str, authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    response = httpx.request(method, f"{server.base_url}{path}", headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")


def test_health_metrics_and_docs_stay_open(server: LiveServer) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200
    assert "/v1/files" in httpx.get(f"{server.base_url}/schema/openapi.json").json()["paths"]
    # Unknown paths with a valid key are a plain 404.
    assert_error(server.http.get("/v1/secrets"), 404, "not_found")


def test_tenants_do_not_see_each_other(server: LiveServer) -> None:
    file_id = server.upload([chat_line("mine")])["id"]
    batch = server.run([chat_line("mine-too")])
    output_id = batch["output_file_id"]
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {OTHER_KEY}"}) as other:
        for path in (f"/v1/files/{file_id}", f"/v1/files/{output_id}", f"/v1/files/{output_id}/content"):
            assert_error(other.get(path), 404, "file_not_found")
        assert_error(other.delete(f"/v1/files/{file_id}"), 404, "file_not_found")
        assert_error(other.get(f"/v1/batches/{batch['id']}"), 404, "batch_not_found")
        assert_error(other.post(f"/v1/batches/{batch['id']}/cancel"), 404, "batch_not_found")
        assert_error(other.post("/v1/batches", json={"input_file_id": file_id}), 404, "file_not_found")
        assert file_id not in [f["id"] for f in other.get("/v1/files").json()["data"]]
        assert batch["id"] not in [b["id"] for b in other.get("/v1/batches").json()["data"]]
        other.post("/v1/files", data={"purpose": "batch"}, files={"file": ("theirs.jsonl", jsonl([chat_line("t")]))})
        # A cursor naming another tenant's object reads exactly like an unknown one: nothing tells that it exists.
        for path, mine in (("/v1/files", file_id), ("/v1/batches", batch["id"])):
            unknown = "file-0123456789abcdef01234567" if path == "/v1/files" else "batch_0123456789abcdef01234567"
            for order in ("asc", "desc") if path == "/v1/files" else ("desc",):
                params = {"order": order} if path == "/v1/files" else {}
                probed = other.get(path, params={**params, "after": mine}).json()
                assert probed == other.get(path, params={**params, "after": unknown}).json()
                assert probed["data"] == [] and probed["has_more"] is False
    # The owner still has everything.
    assert server.http.get(f"/v1/files/{file_id}").status_code == 200
    assert server.lines(output_id)[0]["custom_id"] == "mine-too"
    assert server.http.delete(f"/v1/files/{file_id}").json()["deleted"] is True


def test_upload_over_the_limit(server: LiveServer) -> None:
    content = jsonl([chat_line(f"r{i}", "x" * 500) for i in range(8)])
    assert len(content) > 4096
    response = server.http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", content)})
    assert response.status_code == 413
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("file_too_large", "file")


def test_metadata_limits(server: LiveServer) -> None:
    file_id = server.upload([chat_line("m")])["id"]
    at_the_limits = {f"k{i:02}": "v" * 512 for i in range(15)} | {"x" * 64: "v"}
    accepted = server.create_batch(file_id, metadata=at_the_limits)
    assert accepted["metadata"] == at_the_limits
    server.wait(accepted["id"])
    for metadata in (
        at_the_limits | {"one-too-many": "v"},
        {"x" * 65: "v"},
        {"key": "v" * 513},
    ):
        response = server.http.post("/v1/batches", json={"input_file_id": file_id, "metadata": metadata})
        assert_error(response, 400, "invalid_value", "metadata")


def test_filenames_are_sanitized(server: LiveServer) -> None:
    raw = "../../etc/\x1b[31mevil\u202e.jsonl"  # directories, a terminal escape, a bidi override
    response = server.http.post("/v1/files", data={"purpose": "batch"}, files={"file": (raw, jsonl([chat_line("f")]))})
    assert response.status_code == 200, response.text
    file = response.json()
    assert file["filename"] == "[31mevil.jsonl"
    content = server.http.get(f"/v1/files/{file['id']}/content")
    assert content.headers["content-disposition"] == 'attachment; filename="[31mevil.jsonl"'


def test_a_10000_character_filename_is_sanitized_not_refused(server: LiveServer) -> None:
    raw = "é" * 10_000 + ".jsonl"
    response = server.http.post("/v1/files", data={"purpose": "batch"}, files={"file": (raw, jsonl([chat_line("f")]))})
    assert response.status_code == 200, response.text
    assert response.json()["filename"] == "é" * 124 + ".jsonl"  # 255 bytes at most, the extension kept


@pytest.mark.parametrize("chunked", [False, True])
def test_a_50_mb_online_body_is_refused_at_once(live_server: LiveServer, chunked: bool) -> None:
    """The online limit (--max-online-body-bytes, 4 MiB) is checked before the body is read whole: from its
    Content-Length, or as a chunked body streams in."""
    text = "x" * (50 * 2**20)
    body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": text}]}).encode()
    before, started = live_server.memory_mib(), time.monotonic()
    content = (body[i : i + 2**20] for i in range(0, len(body), 2**20)) if chunked else body
    try:
        response = live_server.http.post(
            "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
        )
    except httpx.RemoteProtocolError:  # the server answered and closed while the client still sent
        response = None
    assert time.monotonic() - started < 10
    if response is not None:
        assert_error(response, 413, "request_too_large")
    assert live_server.memory_mib() - before < 500
    assert live_server.http.get("/health").status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "kind"),
    [
        ("GET", "/v1/files/..%2F..%2Fetc%2Fpasswd", "not_found"),
        ("GET", "/v1/files/..%2Fbatchgen.db/content", "not_found"),
        ("DELETE", "/v1/files/..%2Fbatchgen.db", "not_found"),
        ("GET", "/v1/files/...", "file_not_found"),
        ("GET", "/v1/files/batchgen.db/content", "file_not_found"),
        ("DELETE", "/v1/files/file-..", "file_not_found"),
        ("GET", "/v1/files/file-ABC", "file_not_found"),
        ("GET", "/v1/batches/batch_..", "batch_not_found"),
        ("POST", "/v1/batches/..%2F..%2Fetc/cancel", "not_found"),
    ],
)
def test_ids_that_are_not_ids_are_not_found(server: LiveServer, method: str, path: str, kind: str) -> None:
    # A percent-encoded slash decodes to a real one: no route matches (not_found); any other non-id: no such object.
    assert_error(server.http.request(method, path), 404, kind)
    assert (server.storage_dir / "batchgen.db").exists()
    refused = server.http.post("/v1/batches", json={"input_file_id": "../batchgen.db"})
    assert_error(refused, 404, "file_not_found")


def test_completion_callback_gets_the_final_batch(server: LiveServer) -> None:
    receiver = Receiver([Reply(200)])
    try:
        url = receiver.url + "?batch=1"
        metadata = {"ds_batch_finish_callback": url, "project": "x"}
        done = server.run([chat_line("c1"), chat_line("c2")], metadata=metadata)
        assert done["status"] == "completed"
        deadline = time.monotonic() + 10
        while not receiver.received:
            assert time.monotonic() < deadline, "no callback arrived"
            time.sleep(0.05)
        time.sleep(0.2)  # a second delivery would have arrived by now
        [hit] = receiver.received
        assert hit.path == "/hook?batch=1" and hit.headers["idempotency-key"] == done["id"]
        assert json.loads(hit.body) == server.batch(done["id"])
    finally:
        receiver.close()
    file_id = server.upload([chat_line("c")])["id"]
    refused_urls = ("http://169.254.169.254/latest/meta-data", "file:///etc/passwd", "http://localhost:1/")
    for refused_url in (*refused_urls, "http://127.0.0.1:99999/hook"):
        response = server.http.post(
            "/v1/batches", json={"input_file_id": file_id, "metadata": {"ds_batch_finish_callback": refused_url}}
        )
        assert_error(response, 400, "invalid_value", "metadata.ds_batch_finish_callback")


def test_callbacks_are_off_by_default(live_server: LiveServer) -> None:
    file_id = live_server.upload([chat_line("c")])["id"]
    metadata = {"ds_batch_finish_callback": "http://127.0.0.1:9/hook"}
    response = live_server.http.post("/v1/batches", json={"input_file_id": file_id, "metadata": metadata})
    assert_error(response, 400, "invalid_value", "metadata.ds_batch_finish_callback")
    assert "disabled" in response.json()["error"]["message"]


def test_an_idle_upload_is_dropped(server: LiveServer) -> None:
    """An upload that stops sending is answered 408 after --upload-idle-timeout-s (1 s here) and leaves nothing."""
    boundary = "idle-upload"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="slow.jsonl"\r\n\r\n'
    ).encode() + jsonl([chat_line("first")])
    request = (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(head) + 10_000}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.process.port), timeout=30) as conn:
        conn.sendall(request + head)  # then nothing more
        answer = conn.makefile("rb").read()  # the server answers, then closes
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "upload_timeout"
    assert list((server.storage_dir / "blobs" / ".tmp").iterdir()) == []


def test_backpressure(server: LiveServer) -> None:
    busy = server.create_batch(
        server.upload([chat_line(f"b{i}", max_tokens=1500, ignore_eos=True) for i in range(8)])["id"]
    )
    five = server.upload([chat_line(f"f{i}") for i in range(5)])["id"]

    refused = server.http.post("/v1/batches", json={"input_file_id": five})
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "30"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert refused.json()["error"]["code"] == "queue_full"
    pool = server.http.get("/v1/pool/status").json()
    assert pool["capacity"] == 10 and pool["active_batches"] == 1
    assert pool["queued_requests"] + pool["running_requests"] >= 8

    # Capacity counts sequences (prompts x n), not lines: 11 lines, 3 lines of n=4, one line of 11 prompts.
    prompts = {"custom_id": "p", "method": "POST", "url": "/v1/completions", "body": {"model": "demo"}}
    prompts["body"]["prompt"] = [f"p{i}" for i in range(11)]
    for lines in ([chat_line(f"e{i}") for i in range(11)], [chat_line(f"n{i}", n=4) for i in range(3)], [prompts]):
        too_big = server.http.post("/v1/batches", json={"input_file_id": server.upload(lines)["id"]})
        assert_error(too_big, 400, "batch_too_large", "input_file_id")
        assert "sequences" in too_big.json()["error"]["message"]

    server.http.post(f"/v1/batches/{busy['id']}/cancel")
    assert server.wait(busy["id"], timeout_s=20)["status"] == "cancelled"
    accepted = server.create_batch(five)
    assert server.wait(accepted["id"])["request_counts"] == {"total": 5, "completed": 5, "failed": 0}


@pytest.fixture(scope="module")
def fast_clock(server_factory: Callable[..., LiveServer]) -> LiveServer:
    """A server where an hour of completion_window lasts 0.1 s: "24h" expires after about 2 s."""
    return server_factory("--window-hour-s", "0.1", "--file-sweep-interval-s", "0.2")


def test_expiry_keeps_finished_results_and_answers_the_rest(fast_clock: LiveServer) -> None:
    short = [chat_line(f"short-{i}", max_tokens=2, ignore_eos=True) for i in range(3)]
    long = [chat_line(f"long-{i}", max_tokens=2000, ignore_eos=True) for i in range(3)]
    created = fast_clock.create_batch(fast_clock.upload(short + long)["id"])
    assert created["expires_at"] == created["created_at"] + 2  # round(24 h x 0.1 s)
    batch = fast_clock.wait(created["id"], timeout_s=30)
    assert batch["status"] == "expired" and batch["expired_at"] >= batch["expires_at"]
    assert batch["completed_at"] is None and batch["cancelled_at"] is None
    assert batch["request_counts"] == {"total": 6, "completed": 3, "failed": 3}
    assert sorted(line["custom_id"] for line in fast_clock.lines(batch["output_file_id"])) == [
        "short-0",
        "short-1",
        "short-2",
    ]
    expired = fast_clock.lines(batch["error_file_id"])
    assert sorted(line["custom_id"] for line in expired) == ["long-0", "long-1", "long-2"]
    for line in expired:
        assert line["response"] is None and line["id"].startswith("batch_req_")
        assert line["error"]["code"] == "batch_expired" and line["error"]["message"]
    conflict = fast_clock.http.post(f"/v1/batches/{batch['id']}/cancel")
    assert (conflict.status_code, conflict.json()["error"]["code"]) == (409, "batch_not_cancellable")


def test_expired_files_are_gone(fast_clock: LiveServer) -> None:
    response = fast_clock.http.post(
        "/v1/files",
        data={"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"},
        files={"file": ("soon.jsonl", jsonl([chat_line("e")]))},
    )
    file = response.json()
    assert file["expires_at"] == file["created_at"] + 3600
    kept = fast_clock.upload([chat_line("k")])["id"]
    blob = fast_clock.storage_dir / "blobs" / file["id"]
    assert blob.exists()
    # An hour is too long to wait: move the expiry into the past, as time passing would.
    with sqlite3.connect(fast_clock.storage_dir / "batchgen.db") as db:
        db.execute("UPDATE files SET expires_at = ? WHERE id = ?", (int(time.time()) - 1, file["id"]))
    assert_error(fast_clock.http.get(f"/v1/files/{file['id']}"), 404, "file_not_found")
    assert_error(fast_clock.http.get(f"/v1/files/{file['id']}/content"), 404, "file_not_found")
    assert file["id"] not in [f["id"] for f in fast_clock.http.get("/v1/files").json()["data"]]
    deadline = time.monotonic() + 10
    while blob.exists():  # the periodic sweep deletes the content
        assert time.monotonic() < deadline, "the expired file's content is still there"
        time.sleep(0.1)
    assert fast_clock.http.get(f"/v1/files/{kept}").status_code == 200


def test_output_expires_after_sets_the_results_expiry_and_expiry_deletes_them(fast_clock: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{fast_clock.base_url}/v1", api_key="unused", max_retries=0)
    input_file = fast_clock.upload([chat_line("a", max_tokens=2), chat_line("b", max_tokens=2)])["id"]
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=input_file, endpoint="/v1/chat/completions", completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 60},
        )  # fmt: skip
    created = client.batches.create(
        input_file_id=input_file, endpoint="/v1/chat/completions", completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )  # fmt: skip
    batch = fast_clock.wait(created.id)
    assert batch["status"] == "completed", batch
    output = client.files.retrieve(batch["output_file_id"])
    assert output.expires_at == output.created_at + 7200
    blob = fast_clock.storage_dir / "blobs" / output.id
    with sqlite3.connect(fast_clock.storage_dir / "batchgen.db") as db:  # two hours pass
        db.execute("UPDATE files SET expires_at = ? WHERE id = ?", (int(time.time()) - 1, output.id))
    deadline = time.monotonic() + 10
    while blob.exists():
        assert time.monotonic() < deadline, "the expired output is still there"
        time.sleep(0.1)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(output.id)
    assert client.files.retrieve(input_file).expires_at is None  # the input keeps its own expiry
