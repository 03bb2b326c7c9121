"""``batchgen-server serve``: check the storage, then run the app under uvicorn until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import socket
import sqlite3
import sys
import threading
from types import FrameType
from typing import Any

import uvicorn

from .connections import ConnectionGuard, connection_limits, descriptor_limit, guarded_protocol
from .observability.logs import configure as configure_logs
from .security.auth import InsecureBindError, check_bind_address
from .settings import Settings

log = logging.getLogger("batchgen.server")


def serve(settings: Settings) -> int:
    """Run until SIGTERM/SIGINT; 2 for an unauthenticated non-loopback bind, 1 for storage it cannot open or a model
    it cannot load or serve."""
    from .app import create_app
    from .engine.errors import ModelLoadError
    from .engines import load_engine

    try:
        check_bind_address(settings.host, settings.accepted_keys, settings.insecure)
    except InsecureBindError as exc:
        print(f"batchgen-server: {exc}", file=sys.stderr)
        return 2
    problem = storage_problem(settings)
    if problem is not None:
        print(f"batchgen-server: {problem}", file=sys.stderr)
        return 1
    configure_logs(settings.log_level, settings.log_format)
    try:
        engine = load_engine(settings.engine, settings.cluster)
    except ModelLoadError as exc:
        print(f"batchgen-server: {exc}", file=sys.stderr)
        return 1
    app = create_app(settings, engine)
    max_connections, backlog = connection_limits(descriptor_limit())
    guard = ConnectionGuard(settings.max_connections or max_connections, settings.request_start_timeout_s)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=guarded_protocol(guard),
        backlog=backlog,
        log_level=settings.log_level,
        # Half the deadline for requests in flight, the rest for the engine and the batch loop (app.py).
        timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout_s / 2)),
        access_log=False,
        log_config=None,  # uvicorn's own lines go through the root logger, in the chosen format
    )
    _DrainingServer(config, app.state.draining, guard).run()
    return 0


def storage_problem(settings: Settings) -> str | None:
    """Why the storage cannot be used, in one line; ``None`` when it can. Every directory the server writes is
    written to once, and the database opened for writing, so that a read-only or full disk is this line and exit 1,
    not a failed start-up's traceback."""
    from .storage.database import Database

    try:
        for directory in (settings.storage_dir, settings.blobs_dir / ".tmp"):
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / ".batchgen-write-check"
            probe.write_bytes(b"")
            probe.unlink()
    except OSError as exc:
        return f"the storage directory {settings.storage_dir} cannot be written: {exc.strerror or exc}"
    try:
        Database(settings.database_path).close()
    except sqlite3.DatabaseError as exc:
        if (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF in _UNWRITABLE:
            return f"the database {settings.database_path} cannot be opened for writing ({exc})"
        return (
            f"the database {settings.database_path} cannot be read ({exc}); "
            "restore it from a backup, or move it away to start with an empty one"
        )
    return None


_UNWRITABLE = (
    sqlite3.SQLITE_CANTOPEN,
    sqlite3.SQLITE_READONLY,
    sqlite3.SQLITE_PERM,
    sqlite3.SQLITE_IOERR,
    sqlite3.SQLITE_FULL,
)
"""SQLite's codes for a database file that is fine but cannot be written where it is (not one to restore)."""


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, plus: on the first SIGTERM/SIGINT stop admitting new work (503); failed accepts logged by
    the connection guard, once per episode."""

    def __init__(self, config: uvicorn.Config, draining: threading.Event, guard: ConnectionGuard) -> None:
        super().__init__(config)
        self._draining = draining
        self._guard = guard

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()

        def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            if not self._guard.accept_failed(context):
                loop.default_exception_handler(context)

        loop.set_exception_handler(handle)
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self._draining.is_set():
            self._draining.set()
            log.info("draining: no new work admitted")
        super().handle_exit(sig, frame)
