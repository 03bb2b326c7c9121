"""API-key authentication over real HTTP: 401 envelope, open paths, tenants, constant-time checks, bind policy."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import httpx
import pytest
from litestar import Litestar, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, JSONBody
from litestar.types import ASGIApp

from batchgen.server.security.auth import (
    DEFAULT_TENANT,
    ApiKeyAuthMiddleware,
    InsecureBindError,
    check_bind_address,
    provide_tenant,
    tenant_id,
)

Serve = Callable[[ASGIApp], AbstractContextManager[str]]


@get("/health")
async def health() -> dict[str, str]:
    return {"status": "healthy"}


@get("/metrics")
async def metrics() -> str:
    return "batchgen_requests_total 0"


@get("/v1/files")
async def list_files(tenant: NamedDependency[str]) -> dict[str, str]:
    return {"tenant": tenant}


@get("/v1/files/{file_id:str}")
async def get_file(file_id: FromPath[str], tenant: NamedDependency[str]) -> dict[str, str]:
    return {"id": file_id, "tenant": tenant}


@post("/v1/batches")
async def create_batch(data: JSONBody[dict[str, str]], tenant: NamedDependency[str]) -> dict[str, str]:
    return {**data, "tenant": tenant}


def make_app(api_keys: Sequence[str]) -> Litestar:
    return Litestar(
        [health, metrics, list_files, get_file, create_batch],
        middleware=[ApiKeyAuthMiddleware(api_keys)],
        dependencies={"tenant": Provide(provide_tenant, sync_to_thread=False)},
    )


PROTECTED = [
    ("GET", "/v1/files"),
    ("GET", "/v1/files/file-abc123"),
    ("POST", "/v1/batches"),
]


def _call(client: httpx.Client, method: str, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    body = {"input_file_id": "file-abc123"} if method == "POST" else None
    return client.request(method, path, headers=headers, json=body)


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_every_protected_route_answers_401_without_a_valid_key(serve: Serve, method: str, path: str) -> None:
    with serve(make_app(["key-alpha-123", "key-beta-456"])) as url, httpx.Client(base_url=url) as client:
        missing = _call(client, method, path)
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        assert missing.json() == {
            "error": {
                "message": "Missing API key: send it as 'Authorization: Bearer <key>'.",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
        for wrong in ["key-alpha-12", "key-alpha-1234", "KEY-ALPHA-123", "key-beta-456 key-alpha-123"]:
            response = _call(client, method, path, wrong)
            assert response.status_code == 401, wrong
            assert response.json()["error"]["code"] == "invalid_api_key"
        for header in ["Basic a2V5LWFscGhhLTEyMw==", "Bearer", "key-alpha-123"]:
            assert client.request(method, path, headers={"Authorization": header}).status_code == 401, header
        assert _call(client, method, path, "key-alpha-123").status_code in (200, 201)


def test_each_key_is_its_own_tenant(serve: Serve) -> None:
    with serve(make_app(["key-alpha-123", "key-beta-456"])) as url, httpx.Client(base_url=url) as client:
        alpha = _call(client, "GET", "/v1/files/file-1", "key-alpha-123").json()
        beta = _call(client, "GET", "/v1/files/file-1", "key-beta-456").json()
        created = _call(client, "POST", "/v1/batches", "key-beta-456").json()
        # The scheme is case-insensitive (RFC 7235).
        lower = client.get("/v1/files", headers={"Authorization": "bearer key-alpha-123"}).json()
    assert alpha == {"id": "file-1", "tenant": tenant_id("key-alpha-123")}
    assert beta == {"id": "file-1", "tenant": tenant_id("key-beta-456")}
    assert created == {"input_file_id": "file-abc123", "tenant": tenant_id("key-beta-456")}
    assert lower == {"tenant": tenant_id("key-alpha-123")}
    assert alpha["tenant"] != beta["tenant"]


def test_health_metrics_and_openapi_stay_open(serve: Serve) -> None:
    with serve(make_app(["key-alpha-123"])) as url, httpx.Client(base_url=url) as client:
        assert client.get("/health").json() == {"status": "healthy"}
        assert client.get("/metrics").text == "batchgen_requests_total 0"
        schema = client.get("/schema/openapi.json")
        assert schema.status_code == 200
        assert "/v1/files" in schema.json()["paths"]


def test_without_keys_everyone_is_the_default_tenant(serve: Serve) -> None:
    with serve(make_app([])) as url, httpx.Client(base_url=url) as client:
        assert client.get("/v1/files").json() == {"tenant": DEFAULT_TENANT}
        assert _call(client, "GET", "/v1/files", "anything").json() == {"tenant": DEFAULT_TENANT}


def test_tenant_ids_are_stable_and_do_not_reveal_the_key() -> None:
    assert tenant_id("key-alpha-123") == tenant_id("key-alpha-123")
    assert tenant_id("key-alpha-123") != tenant_id("key-alpha-124")
    assert "alpha" not in tenant_id("key-alpha-123")
    assert len(tenant_id("k")) == 25
    assert tenant_id("k") != DEFAULT_TENANT


def test_every_key_is_compared_even_after_a_match(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    compare_digest = hmac.compare_digest

    def counting_compare(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare_digest(a, b)

    middleware = ApiKeyAuthMiddleware(["first-key", "second-key", "third-key"])
    monkeypatch.setattr(hmac, "compare_digest", counting_compare)
    assert middleware.authenticate("first-key") == tenant_id("first-key")
    assert middleware.authenticate("nope") is None
    assert len(calls) == 6
    # Digests of equal length whatever the token, so the comparison time says nothing about key lengths.
    assert {len(a) for a, _ in calls} == {32}


def test_blank_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="blank"):
        ApiKeyAuthMiddleware(["good", "  "])


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_binds_without_keys(host: str) -> None:
    check_bind_address(host, [], insecure=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "example.com", "localhost.example.com"])
def test_public_bind_without_keys_is_refused_unless_insecure(host: str) -> None:
    with pytest.raises(InsecureBindError, match=r"--api-key .* --insecure"):
        check_bind_address(host, [], insecure=False)
    check_bind_address(host, ["a-key"], insecure=False)
    check_bind_address(host, [], insecure=True)
