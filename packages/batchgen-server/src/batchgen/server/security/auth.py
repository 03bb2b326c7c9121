"""API-key authentication: every route but ``/health``, ``/metrics``, the OpenAPI docs and the console's page and
assets needs a Bearer key.

Each key is a tenant. Handlers read the tenant id of the caller from ``request.user`` (the server injects it as
``owner`` through :func:`provide_tenant`); it is a truncated sha256 of the key, stable across restarts and useless
for recovering the key, and it is what storage records as each file's and batch's ``owner``. With no key configured
every caller is :data:`DEFAULT_TENANT`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Sequence
from typing import Any

import msgspec
from litestar import Request
from litestar.datastructures import State
from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, HTTPResponseBodyEvent, HTTPResponseStartEvent, Receive, Scope, Send

from batchgen.schemas import ErrorDetail, ErrorResponse

DEFAULT_TENANT = ""
"""Every caller's tenant when no key is configured."""
OPEN_PATHS: frozenset[str] = frozenset({"/health", "/metrics", "/"})
"""Probes and scrapers (liveness and server-wide aggregates, nothing of any tenant's files or batches), and the
console's page, which asks for a key itself before it calls the API."""
OPEN_PREFIXES = ("/schema", "/console")
"""The OpenAPI document and its viewers, the console's script and style: they hold no data."""


def tenant_id(api_key: str) -> str:
    """The tenant a key stands for: 96 bits of its sha256, so ids never collide in practice and never leak the key."""
    return "t" + hashlib.sha256(api_key.encode()).hexdigest()[:24]


def _is_open(path: str) -> bool:
    # Exact paths, and no ``..`` under the open prefixes: nothing a router might resolve elsewhere is ever open.
    if path in OPEN_PATHS or path in OPEN_PREFIXES:
        return True
    return path.startswith(tuple(prefix + "/" for prefix in OPEN_PREFIXES)) and ".." not in path


def _bearer_token(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


class ApiKeyAuthMiddleware(ASGIMiddleware):
    """Litestar middleware: ``Litestar(middleware=[ApiKeyAuthMiddleware(settings.api_keys)])``."""

    scopes = (ScopeType.HTTP,)

    def __init__(self, api_keys: Sequence[str]) -> None:
        if any(not key.strip() for key in api_keys):
            raise ValueError("API keys must not be empty or blank")
        # Keys are compared through their sha256 digests: equal length, so ``compare_digest`` leaks no key length.
        self._keys = [(hashlib.sha256(key.encode()).digest(), tenant_id(key)) for key in api_keys]

    def authenticate(self, token: str | None) -> str | None:
        """The tenant of ``token``, or ``None``. Every key is compared, with no early exit, in constant time."""
        if not self._keys:
            return DEFAULT_TENANT
        if token is None:
            return None
        digest = hashlib.sha256(token.encode()).digest()
        tenant = None
        for key_digest, key_tenant in self._keys:
            if hmac.compare_digest(digest, key_digest):
                tenant = key_tenant
        return tenant

    def rejection(self, scope: Scope) -> ErrorResponse | None:
        """The 401 answer owed to this request, or ``None`` (after recording its tenant in ``scope["user"]``).

        The middleware asks this of every routed request; the 404/405 error handler asks it of unrouted ones, so
        a caller without a key cannot even tell which ``/v1`` paths exist.
        """
        if _is_open(scope["path"]):
            return None
        token = _bearer_token(scope)
        tenant = self.authenticate(token)
        if tenant is None:
            message = (
                "Missing API key: send it as 'Authorization: Bearer <key>'."
                if token is None
                else "Incorrect API key provided."
            )
            error = ErrorDetail(message=message, type="authentication_error", code="invalid_api_key")
            return ErrorResponse(error=error)
        scope["user"] = tenant
        return None

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        error = self.rejection(scope)
        if error is None:
            await next_app(scope, receive, send)
        else:
            await _send_unauthorized(send, error)


UNAUTHORIZED_HEADERS = {"WWW-Authenticate": "Bearer"}


async def _send_unauthorized(send: Send, error: ErrorResponse) -> None:
    body = msgspec.json.encode(error)
    start: HTTPResponseStartEvent = {
        "type": "http.response.start",
        "status": 401,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *((name.lower().encode(), value.encode()) for name, value in UNAUTHORIZED_HEADERS.items()),
        ],
    }
    await send(start)
    end: HTTPResponseBodyEvent = {"type": "http.response.body", "body": body, "more_body": False}
    await send(end)


def provide_tenant(request: Request[str, Any, State]) -> str:
    """Litestar dependency: the caller's tenant, as the middleware recorded it."""
    tenant: str = request.user
    return tenant


class InsecureBindError(ValueError):
    """Raised when the server would listen beyond this machine with no API key."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


def check_bind_address(host: str, api_keys: Sequence[str], insecure: bool) -> None:
    """Refuse to serve an unauthenticated API on a non-loopback address unless the operator said ``insecure``."""
    if api_keys or insecure or is_loopback(host):
        return
    raise InsecureBindError(
        f"Refusing to listen on {host!r} without an API key: anyone who can reach this address could read and run "
        "batches. Set --api-key KEY (or BATCHGEN_API_KEYS), bind 127.0.0.1, or pass --insecure if the network is "
        "trusted."
    )
