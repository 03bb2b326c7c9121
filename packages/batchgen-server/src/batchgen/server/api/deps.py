"""What the controllers share (the server's parts, reached through Litestar's dependency injection): the context,
the caller's tenant (``owner``, set by :class:`~batchgen.server.security.auth.ApiKeyAuthMiddleware`), and the
refusal of new work while a graceful shutdown drains."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.di import Provide
from litestar.handlers import BaseRouteHandler

from batchgen.schemas import ModelObject

from ..batches.loop import BatchLoop
from ..engine.interface import EngineClient
from ..observability.metrics import Metrics
from ..security.auth import provide_tenant
from ..serving import OpenAIServing
from ..settings import Settings
from ..storage.blobs import BlobStore
from ..storage.database import Database
from .engine_calls import OnlineRequests
from .errors import APIError
from .preparations import Preparations


@dataclass(slots=True)
class ServerContext:
    settings: Settings
    db: Database
    blobs: BlobStore
    models: list[ModelObject]
    """The served model under each of its names, its id first."""
    engine: EngineClient
    loop: BatchLoop
    metrics: Metrics
    serving: OpenAIServing
    online: OnlineRequests
    preparations: Preparations
    """The threads online requests are prepared in."""

    @property
    def model(self) -> ModelObject:
        return self.models[0]


def now() -> int:
    return int(time.time())


def _context(request: Request[Any, Any, Any]) -> ServerContext:
    context: ServerContext = request.app.state.context
    return context


def ensure_admitting(connection: ASGIConnection[Any, Any, Any, Any]) -> None:
    """503 once the server is draining: the caller retries against the restarted server."""
    draining: threading.Event = connection.app.state.draining  # set by the SIGTERM handler (serve.py)
    if draining.is_set():
        raise APIError(
            503,
            "The server is shutting down and admits no new work; retry shortly.",
            code="server_shutting_down",
            headers={"Retry-After": "5"},
        )


async def admit_while_running(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Guard of the API: while draining, requests that create or change something (POST, DELETE) get a 503. A
    coroutine: Litestar runs a plain function's guard in a worker thread, where a pool full of slow work once held
    every request."""
    if isinstance(connection, Request) and connection.method in ("POST", "DELETE"):
        ensure_admitting(connection)


DEPENDENCIES = {
    "context": Provide(_context, sync_to_thread=False),
    "owner": Provide(provide_tenant, sync_to_thread=False),
}
