"""What the controllers share (the server's parts, reached through Litestar's dependency injection) and the
authentication that decides who the caller is."""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.di import Provide
from litestar.handlers import BaseRouteHandler

from batchgen.schemas import ModelObject

from ..batches.runner import BatchRunner
from ..engine import EngineWorker
from ..settings import Settings
from ..storage.blobs import BlobStore
from ..storage.database import Database
from .errors import APIError


@dataclass(slots=True)
class ServerContext:
    settings: Settings
    db: Database
    blobs: BlobStore
    model: ModelObject
    worker: EngineWorker
    runner: BatchRunner


def now() -> int:
    return int(time.time())


def _context(request: Request[Any, Any, Any]) -> ServerContext:
    context: ServerContext = request.app.state.context
    return context


def _bearer_key(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    scheme, _, key = connection.headers.get("authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def require_api_key(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Guard of every ``/v1`` route: with keys configured, a valid Bearer key (compared in constant time)."""
    keys: tuple[str, ...] = connection.app.state.context.settings.api_keys
    if not keys:
        return
    given = _bearer_key(connection).encode()
    # Compare against every key so the time taken does not tell which one (or whether any) matched.
    matched = [hmac.compare_digest(given, key.encode()) for key in keys]
    if not any(matched):
        raise APIError(
            401,
            "Missing or invalid API key; send it as 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _owner(request: Request[Any, Any, Any]) -> str:
    """The tenant: a digest of the caller's API key (``""`` when the server has no keys)."""
    if not request.app.state.context.settings.api_keys:
        return ""
    return hashlib.sha256(_bearer_key(request).encode()).hexdigest()[:32]


DEPENDENCIES = {
    "context": Provide(_context, sync_to_thread=False),
    "owner": Provide(_owner, sync_to_thread=False),
}
