"""Fixtures for the client tests: respx-mocked server, both clients behind one synchronous test interface."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import respx

from batchgen.client import AsyncBatchGenHttpClient, BatchGenHttpClient

BASE = "http://batchgen.test"


def file_json(file_id: str = "file-abc", **fields: Any) -> dict[str, Any]:
    return {
        "id": file_id,
        "object": "file",
        "bytes": 120,
        "created_at": 1710000000,
        "filename": "requests.jsonl",
        "purpose": "batch",
        "status": "processed",
        "status_details": None,
        "expires_at": None,
        "checksum": "sha256:00",
        **fields,
    }


def batch_json(batch_id: str = "batch_abc", status: str = "validating", **fields: Any) -> dict[str, Any]:
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": "/v1/chat/completions",
        "model": "demo",
        "errors": None,
        "input_file_id": "file-abc",
        "completion_window": "24h",
        "status": status,
        "output_file_id": None,
        "error_file_id": None,
        "created_at": 1710000000,
        "request_counts": {"total": 2, "completed": 0, "failed": 0},
        "metadata": None,
        **fields,
    }


def output_line(custom_id: str, content: str = "hi") -> dict[str, Any]:
    return {
        "id": f"batch_req_{custom_id}",
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": f"req_{custom_id}",
            "body": {
                "id": f"chatcmpl-{custom_id}",
                "object": "chat.completion",
                "created": 1710000001,
                "model": "demo",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            },
        },
        "error": None,
    }


def error_line(custom_id: str) -> dict[str, Any]:
    return {
        "id": f"batch_req_{custom_id}",
        "custom_id": custom_id,
        "response": {
            "status_code": 400,
            "request_id": f"req_{custom_id}",
            "body": {
                "error": {
                    "message": "prompt too long",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "context_length_exceeded",
                }
            },
        },
        "error": None,
    }


async def _collect(items: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in items]


class SyncView:
    """Drives an ``AsyncBatchGenHttpClient`` from synchronous test code, so each test body runs against both clients."""

    def __init__(self, client: AsyncBatchGenHttpClient, loop: asyncio.AbstractEventLoop) -> None:
        self._client = client
        self._loop = loop

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            if inspect.isawaitable(result):
                return self._loop.run_until_complete(result)
            if hasattr(result, "__aiter__"):
                return iter(self._loop.run_until_complete(_collect(result)))
            return result

        return call


@pytest.fixture
def mock() -> Iterator[respx.MockRouter]:
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        yield router


@pytest.fixture
def sleeps() -> list[float]:
    """Every delay a client asked to sleep for; the clients never really sleep in these tests."""
    return []


@pytest.fixture(params=["sync", "async"])
def make_client(
    request: pytest.FixtureRequest, sleeps: list[float], mock: respx.MockRouter
) -> Iterator[Callable[..., Any]]:
    """Build a client (sync, or async behind a ``SyncView``) against the mocked server."""
    loop = asyncio.new_event_loop()
    closers: list[Callable[[], Any]] = []

    async def async_sleep(delay: float) -> None:
        sleeps.append(delay)

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("api_key", "sk-test")
        if request.param == "sync":
            client = BatchGenHttpClient(BASE, sleep=sleeps.append, **kwargs)
            closers.append(client.close)
            return client
        async_client = AsyncBatchGenHttpClient(BASE, sleep=async_sleep, **kwargs)
        closers.append(lambda: loop.run_until_complete(async_client.close()))
        return SyncView(async_client, loop)

    yield make
    for close in closers:
        close()
    loop.close()


@pytest.fixture
def client(make_client: Callable[..., Any]) -> Any:
    return make_client()
