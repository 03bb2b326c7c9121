"""Error mapping, retries with backoff and Retry-After, and idempotency keys across retries, for both clients."""

from __future__ import annotations

import email.utils
import io
import time
from typing import Any

import httpx
import pytest
import respx

from batchgen.client import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    BatchGenError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
)
from batchgen.client._core import RetryPolicy

from .conftest import batch_json, file_json
from .test_client_requests import JSONL, multipart_fields


def envelope(
    message: str = "bad thing", code: str | None = "bad_code", param: str | None = "endpoint"
) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


@pytest.mark.parametrize(
    ("status", "error_class"),
    [
        (400, BadRequestError),
        (401, AuthenticationError),
        (403, PermissionDeniedError),
        (404, NotFoundError),
        (409, ConflictError),
        (413, RequestTooLargeError),
        (422, BadRequestError),
        (429, RateLimitError),
        (500, InternalServerError),
        (503, InternalServerError),
        (418, APIStatusError),
    ],
)
def test_status_maps_to_error_class(
    make_client: Any, mock: respx.MockRouter, status: int, error_class: type[APIStatusError]
) -> None:
    mock.get("/v1/batches/batch_abc").respond(status, json=envelope(), headers={"x-request-id": "req-123"})
    with pytest.raises(error_class) as caught:
        make_client(max_retries=0).get_batch("batch_abc")
    error = caught.value
    assert type(error) is error_class
    assert (error.status_code, error.message, error.code, error.param, error.type, error.request_id) == (
        status,
        "bad thing",
        "bad_code",
        "endpoint",
        "invalid_request_error",
        "req-123",
    )
    assert isinstance(error, BatchGenError) and isinstance(error, RuntimeError)
    assert str(error) == f"{status}: bad thing (code=bad_code, param=endpoint, request_id=req-123)"


def test_error_without_envelope_keeps_the_body_as_message(client: Any, mock: respx.MockRouter) -> None:
    mock.get("/v1/files/file-abc").respond(404, text="Not Found")
    with pytest.raises(NotFoundError) as caught:
        client.get_file("file-abc")
    assert (caught.value.message, caught.value.code, caught.value.request_id) == ("Not Found", None, None)


def test_unexpected_success_body_is_an_api_error(client: Any, mock: respx.MockRouter) -> None:
    from batchgen.client import APIError

    mock.get("/v1/files/file-abc").respond(200, json={"id": "file-abc"})
    with pytest.raises(APIError, match="unexpected response to GET /v1/files/file-abc"):
        client.get_file("file-abc")


def test_retry_after_seconds_is_honoured(client: Any, mock: respx.MockRouter, sleeps: list[float]) -> None:
    route = mock.get("/v1/batches/batch_abc").mock(
        side_effect=[
            httpx.Response(429, json=envelope("at capacity"), headers={"retry-after": "3"}),
            httpx.Response(503, json=envelope("busy"), headers={"retry-after-ms": "1500"}),
            httpx.Response(200, json=batch_json()),
        ]
    )
    assert client.get_batch("batch_abc").id == "batch_abc"
    assert sleeps == [3.0, 1.5]
    assert route.call_count == 3


def test_retry_after_http_date(client: Any, mock: respx.MockRouter, sleeps: list[float]) -> None:
    when = email.utils.formatdate(time.time() + 10, usegmt=True)
    mock.get("/v1/batches/batch_abc").mock(
        side_effect=[httpx.Response(429, headers={"retry-after": when}), httpx.Response(200, json=batch_json())]
    )
    client.get_batch("batch_abc")
    assert len(sleeps) == 1 and 8.0 < sleeps[0] <= 10.0


def test_exponential_backoff_with_jitter_then_give_up(
    make_client: Any, mock: respx.MockRouter, sleeps: list[float]
) -> None:
    route = mock.get("/v1/batches/batch_abc").respond(502, json=envelope("bad gateway"))
    with pytest.raises(InternalServerError, match="bad gateway"):
        make_client(max_retries=4).get_batch("batch_abc")
    assert route.call_count == 5
    for attempt, delay in enumerate(sleeps):
        nominal = 0.5 * 2**attempt
        assert 0.75 * nominal <= delay <= nominal
    assert len(sleeps) == 4


def test_backoff_policy_is_capped_and_ignores_absurd_retry_after() -> None:
    policy = RetryPolicy(max_retries=10, random=lambda: 0.0)
    assert [policy.delay(attempt) for attempt in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    request = httpx.Request("GET", "http://x")
    assert policy.delay(0, httpx.Response(429, headers={"retry-after": "3600"}, request=request)) == 0.5
    assert policy.delay(0, httpx.Response(429, headers={"retry-after": "soon"}, request=request)) == 0.5
    assert RetryPolicy(random=lambda: 1.0).delay(1) == 0.75


@pytest.mark.parametrize("status", [400, 401, 404, 409, 413, 422])
def test_client_errors_are_not_retried(client: Any, mock: respx.MockRouter, sleeps: list[float], status: int) -> None:
    route = mock.get("/v1/batches/batch_abc").respond(status, json=envelope())
    with pytest.raises(APIStatusError):
        client.get_batch("batch_abc")
    assert route.call_count == 1 and sleeps == []


def test_408_is_retried(client: Any, mock: respx.MockRouter, sleeps: list[float]) -> None:
    mock.get("/v1/models").mock(
        side_effect=[httpx.Response(408), httpx.Response(200, json={"object": "list", "data": []})]
    )
    assert client.list_models().data == []
    assert len(sleeps) == 1


def test_connection_errors_are_retried_then_raised(
    make_client: Any, mock: respx.MockRouter, sleeps: list[float]
) -> None:
    route = mock.get("/v1/models").mock(side_effect=httpx.ConnectError("connection refused"))
    with pytest.raises(APIConnectionError, match="connection refused") as caught:
        make_client(max_retries=2).list_models()
    assert not isinstance(caught.value, APITimeoutError)
    assert route.call_count == 3 and len(sleeps) == 2


def test_timeouts_raise_api_timeout_error(make_client: Any, mock: respx.MockRouter) -> None:
    route = mock.get("/v1/models").mock(side_effect=httpx.ReadTimeout("too slow"))
    with pytest.raises(APITimeoutError):
        make_client(max_retries=1).list_models()
    assert route.call_count == 2


def test_a_connection_error_then_success(client: Any, mock: respx.MockRouter) -> None:
    mock.get("/v1/models").mock(
        side_effect=[httpx.ConnectError("reset"), httpx.Response(200, json={"object": "list", "data": []})]
    )
    assert client.list_models().data == []


def test_create_batch_reuses_its_idempotency_key_across_retries(client: Any, mock: respx.MockRouter) -> None:
    route = mock.post("/v1/batches").mock(
        side_effect=[httpx.ConnectError("reset"), httpx.Response(500), httpx.Response(200, json=batch_json())]
    )
    client.create_batch("file-abc")
    keys = {call.request.headers["idempotency-key"] for call in route.calls}
    assert route.call_count == 3 and len(keys) == 1
    assert len({call.request.content for call in route.calls}) == 1


def test_upload_retries_resend_the_whole_file_with_the_same_key(client: Any, mock: respx.MockRouter) -> None:
    route = mock.post("/v1/files").mock(side_effect=[httpx.Response(503), httpx.Response(200, json=file_json())])
    client.upload_file(io.BytesIO(JSONL), filename="requests.jsonl")
    assert route.call_count == 2
    first, second = (call.request for call in route.calls)
    assert first.headers["idempotency-key"] == second.headers["idempotency-key"]
    assert multipart_fields(first)["file"] == multipart_fields(second)["file"] == ("requests.jsonl", JSONL)


class _Pipe(io.RawIOBase):
    """A non-seekable binary stream, like a pipe."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        chunk = self._data.read(len(buffer))
        buffer[: len(chunk)] = chunk
        return len(chunk)


def test_non_seekable_upload_is_not_retried(client: Any, mock: respx.MockRouter, sleeps: list[float]) -> None:
    route = mock.post("/v1/files").respond(503, json=envelope("busy"))
    with pytest.raises(InternalServerError):
        client.upload_file(_Pipe(JSONL))
    assert route.call_count == 1 and sleeps == []
    route.respond(200, json=file_json())
    client.upload_file(_Pipe(JSONL), filename="requests.jsonl")
    assert multipart_fields(route.calls.last.request)["file"] == ("requests.jsonl", JSONL)
