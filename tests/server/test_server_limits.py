"""A server with API keys, a small queue capacity and a small upload limit: 401, 404 across tenants, 413, 429."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from server_helpers import LiveServer, chat_line, jsonl

KEY, OTHER_KEY = "key-one", "key-two"


@pytest.fixture(scope="module")
def server(server_factory: Callable[..., LiveServer]) -> LiveServer:
    return server_factory(
        "--max-queued-requests", "10", "--max-upload-bytes", "4096", "--api-key", OTHER_KEY, api_key=KEY
    )


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
        ("GET", "/v1/pool/status"),
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


def test_health_and_metrics_stay_open(server: LiveServer) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


def test_tenants_do_not_see_each_other(server: LiveServer) -> None:
    file_id = server.upload([chat_line("mine")])["id"]
    other = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {OTHER_KEY}"})
    assert other.get(f"/v1/files/{file_id}").status_code == 404
    assert file_id not in [f["id"] for f in other.get("/v1/files").json()["data"]]
    refused = other.post("/v1/batches", json={"input_file_id": file_id})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "file_not_found"


def test_upload_over_the_limit(server: LiveServer) -> None:
    content = jsonl([chat_line(f"r{i}", "x" * 500) for i in range(8)])
    assert len(content) > 4096
    response = server.http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", content)})
    assert response.status_code == 413
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("file_too_large", "file")


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

    eleven = server.upload([chat_line(f"e{i}") for i in range(11)])["id"]
    too_big = server.http.post("/v1/batches", json={"input_file_id": eleven})
    assert (too_big.status_code, too_big.json()["error"]["code"]) == (400, "batch_too_large")

    server.http.post(f"/v1/batches/{busy['id']}/cancel")
    assert server.wait(busy["id"], timeout_s=20)["status"] == "cancelled"
    accepted = server.create_batch(five)
    assert server.wait(accepted["id"])["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
