"""``batchgen-server serve``: check the storage, then run the app under uvicorn until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import sqlite3
import sys
import threading
from types import FrameType

import uvicorn

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
        check_bind_address(settings.host, settings.api_keys, settings.insecure)
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
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # Half the deadline for requests in flight, the rest for the engine and the batch loop (app.py).
        timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout_s / 2)),
        access_log=False,
        log_config=None,  # uvicorn's own lines go through the root logger, in the chosen format
    )
    _DrainingServer(config, app.state.draining).run()
    return 0


def storage_problem(settings: Settings) -> str | None:
    """Why the storage directory or its database cannot be used, in one line; ``None`` when they can."""
    from .storage.database import Database

    try:
        settings.storage_dir.mkdir(parents=True, exist_ok=True)
        Database(settings.database_path).close()
    except sqlite3.DatabaseError as exc:
        return (
            f"the database {settings.database_path} cannot be read ({exc}); "
            "restore it from a backup, or move it away to start with an empty one"
        )
    except OSError as exc:
        return f"the storage directory {settings.storage_dir} cannot be used: {exc.strerror or exc}"
    return None


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, plus: on the first SIGTERM/SIGINT stop admitting new work (503)."""

    def __init__(self, config: uvicorn.Config, draining: threading.Event) -> None:
        super().__init__(config)
        self._draining = draining

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self._draining.is_set():
            self._draining.set()
            log.info("draining: no new work admitted")
        super().handle_exit(sig, frame)
