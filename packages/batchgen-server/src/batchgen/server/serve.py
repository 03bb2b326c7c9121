"""``batchgen-server serve``: the server's flags (each also a ``BATCHGEN_*`` variable), then uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from .engine import EngineConfig
from .security.auth import InsecureBindError, check_bind_address
from .settings import Settings

log = logging.getLogger("batchgen.server")

_SERVER_FLAGS: dict[str, dict[str, Any]] = {
    "host": {},
    "port": {"type": int},
    "storage_dir": {"type": Path, "flags": ("--storage", "--storage-dir"), "help": "metadata and file contents"},
    "api_keys": {"flags": ("--api-key",), "action": "append", "help": "accepted Bearer key (repeat for several)"},
    "insecure": {"action": "store_true", "help": "allow a non-loopback --host without an API key"},
    "callback_allowed_hosts": {
        "flags": ("--callback-allowed-host",),
        "action": "append",
        "help": "host completion callbacks may reach (repeat for several; none: callbacks off)",
    },
    "shutdown_timeout_s": {"type": float, "help": "after SIGTERM, exit within this many seconds"},
    "file_sweep_interval_s": {"type": float, "help": "how often expired files are deleted"},
    "max_queued_requests": {"type": int, "help": "capacity: queued requests before POST /v1/batches answers 429"},
    "retry_after_s": {"type": int, "help": "Retry-After of a 429"},
    "max_upload_bytes": {"type": int},
    "max_requests_per_file": {"type": int},
    "max_line_bytes": {"type": int},
    "flush_interval_s": {"type": float, "help": "how often results are fsynced (at most 1 s)"},
    "window_hour_s": {"type": float, "help": "seconds per hour of completion_window (tests shrink time with it)"},
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's settings as flags; an unset flag falls back to its BATCHGEN_* variable, then the default."""
    group = parser.add_argument_group("server")
    for name, options in _SERVER_FLAGS.items():
        options = dict(options)
        flags = options.pop("flags", (f"--{name.replace('_', '-')}",))
        group.add_argument(*flags, dest=name, default=None, **options)
    group.add_argument("--log-level", default=os.environ.get("BATCHGEN_LOG_LEVEL", "info"))


def settings_from_args(args: argparse.Namespace, engine: EngineConfig) -> Settings:
    overrides = {name: getattr(args, name) for name in _SERVER_FLAGS}
    for name in ("api_keys", "callback_allowed_hosts"):
        if overrides[name] is not None:
            overrides[name] = tuple(overrides[name])
    return Settings.from_env(**overrides, engine=engine)


def serve(settings: Settings, *, log_level: str = "info") -> int:
    """Run until SIGTERM/SIGINT; 2 (and a message) for an unauthenticated non-loopback bind."""
    from .app import create_app

    try:
        check_bind_address(settings.host, settings.api_keys, settings.insecure)
    except InsecureBindError as exc:
        print(f"batchgen-server: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        # Half the deadline for requests in flight, the rest for the engine and the writer (app.py).
        timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout_s / 2)),
        access_log=False,
    )
    _DrainingServer(config, app.state.draining, settings.shutdown_timeout_s).run()
    return 0


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, plus: on the first SIGTERM/SIGINT stop admitting (503) and arm the exit deadline."""

    def __init__(self, config: uvicorn.Config, draining: threading.Event, deadline_s: float) -> None:
        super().__init__(config)
        self._draining = draining
        self._deadline_s = deadline_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self._draining.is_set():
            self._draining.set()
            log.info("draining: no new work admitted; exiting within %.0f s", self._deadline_s)
            watchdog = threading.Timer(self._deadline_s, _exit_now, args=(self._deadline_s,))
            watchdog.daemon = True
            watchdog.start()
        super().handle_exit(sig, frame)


def _exit_now(deadline_s: float) -> None:
    log.error("shutdown did not finish within %.0f s; exiting (accepted work is on disk and resumes)", deadline_s)
    logging.shutdown()
    os._exit(1)
