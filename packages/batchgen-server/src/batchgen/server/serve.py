"""``batchgen-server serve``: flags built from ``Settings`` and ``EngineConfig``, then uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from .engine import EngineConfig
from .settings import Settings

_SERVER_FLAGS: dict[str, dict[str, Any]] = {
    "model": {"help": "demo (a tiny built-in model), a local directory or a Hugging Face hub id"},
    "host": {},
    "port": {"type": int},
    "storage_dir": {"type": Path, "flags": ("--storage", "--storage-dir"), "help": "metadata and file contents"},
    "api_keys": {"flags": ("--api-key",), "action": "append", "help": "accepted Bearer key (repeat for several)"},
    "max_queued_requests": {"type": int, "help": "capacity: queued requests before POST /v1/batches answers 429"},
    "retry_after_s": {"type": int},
    "max_upload_bytes": {"type": int},
    "max_requests_per_file": {"type": int},
    "max_line_bytes": {"type": int},
    "flush_interval_s": {"type": float, "help": "how often results are fsynced (at most 1 s)"},
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Every server setting and engine knob as a flag; unset flags fall back to BATCHGEN_* variables, then defaults."""
    for name, options in _SERVER_FLAGS.items():
        options = dict(options)
        flags = options.pop("flags", (f"--{name.replace('_', '-')}",))
        parser.add_argument(*flags, dest=name, default=None, **options)
    engine = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineConfig):
        if field.name == "model":
            continue
        flag = f"--{field.name.replace('_', '-')}"
        if "bool" in str(field.type):
            engine.add_argument(flag, dest=f"engine_{field.name}", default=None, action=argparse.BooleanOptionalAction)
        else:
            engine.add_argument(flag, dest=f"engine_{field.name}", default=None, type=_field_type(field))
    parser.add_argument("--log-level", default=os.environ.get("BATCHGEN_LOG_LEVEL", "info"))


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {name: getattr(args, name) for name in _SERVER_FLAGS}
    if overrides["api_keys"] is not None:
        overrides["api_keys"] = tuple(overrides["api_keys"])
    engine: dict[str, Any] = {}
    for field in dataclasses.fields(EngineConfig):
        value = getattr(args, f"engine_{field.name}", None)
        raw = os.environ.get(f"BATCHGEN_{field.name.upper()}")
        if value is None and raw is not None and field.name != "model":
            value = raw.lower() in {"1", "true", "yes"} if "bool" in str(field.type) else _field_type(field)(raw)
        if value is not None and field.name != "model":
            engine[field.name] = value
    return Settings.from_env(**overrides, engine=engine)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app

    settings = settings_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=30,
    )
    return 0


def _field_type(field: dataclasses.Field[Any]) -> type:
    text = str(field.type)
    return int if "int" in text else float if "float" in text else str
