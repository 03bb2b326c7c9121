"""``batchgen-server serve``: the server's flags (each also a ``BATCHGEN_*`` variable), then uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from .engine import EngineConfig
from .settings import Settings

_SERVER_FLAGS: dict[str, dict[str, Any]] = {
    "host": {},
    "port": {"type": int},
    "storage_dir": {"type": Path, "flags": ("--storage", "--storage-dir"), "help": "metadata and file contents"},
    "api_keys": {"flags": ("--api-key",), "action": "append", "help": "accepted Bearer key (repeat for several)"},
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
    if overrides["api_keys"] is not None:
        overrides["api_keys"] = tuple(overrides["api_keys"])
    return Settings.from_env(**overrides, engine=engine)


def serve(settings: Settings, *, log_level: str = "info") -> int:
    import uvicorn

    from .app import create_app

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        timeout_graceful_shutdown=30,
        access_log=False,
    )
    return 0
