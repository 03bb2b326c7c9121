"""Every setting of the server in one place: defaults here, overridden by ``BATCHGEN_*`` environment variables,
overridden by command-line flags (``serve.py``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.schemas.validation import ValidationLimits

from .callbacks import CallbackSettings
from .engine.config import EngineConfig

MIB = 1024 * 1024


@dataclass(slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 10900
    storage_dir: Path = Path("batchgen-data")
    """SQLite metadata (``batchgen.db``) and file contents (``blobs/``)."""
    api_keys: tuple[str, ...] = ()
    """Bearer keys accepted on ``/v1``; none configured means no authentication (loopback only, unless insecure)."""
    insecure: bool = False
    """Allow listening on a non-loopback address with no API key (a trusted network)."""
    callback_allowed_hosts: tuple[str, ...] = ()
    """Hosts completion callbacks may reach (exact names or IPs); none means callbacks are off."""
    shutdown_timeout_s: float = 30.0
    """After SIGTERM: in-flight requests, then the engine and the writer, must be done by then, or the process exits
    anyway (everything accepted is on disk; the next start resumes it)."""
    file_sweep_interval_s: float = 60.0
    """How often files past their ``expires_after`` are deleted (also once at startup)."""
    max_queued_requests: int = 100_000
    """Capacity: most requests waiting or running across all batches before ``POST /v1/batches`` answers 429."""
    retry_after_s: int = 30
    """``Retry-After`` sent with a 429."""
    max_upload_bytes: int = 200 * MIB
    max_requests_per_file: int = 50_000
    max_line_bytes: int = 8 * MIB
    window_hour_s: float = 3600.0
    """Seconds in one hour of a ``completion_window``: tests shrink it to see batches expire without waiting."""
    flush_interval_s: float = 0.5
    """How often finished results are fsynced and the live counts published (at most once a second)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The model and the engine's knobs (``BATCHGEN_MODEL`` names the model when no config is given)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults, then ``BATCHGEN_<FIELD>`` variables, then ``overrides`` (those not ``None``)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f"BATCHGEN_{f.name.upper()}")
            if raw is not None and f.name != "engine":
                values[f.name] = _parse(f.name, raw)
        if "BATCHGEN_MODEL" in environ:
            values["engine"] = EngineConfig(model=environ["BATCHGEN_MODEL"])
        values.update({key: value for key, value in overrides.items() if value is not None})
        return cls(**values)

    @property
    def database_path(self) -> Path:
        return self.storage_dir / "batchgen.db"

    @property
    def blobs_dir(self) -> Path:
        return self.storage_dir / "blobs"

    @property
    def callbacks(self) -> CallbackSettings:
        return CallbackSettings(allowed_hosts=frozenset(self.callback_allowed_hosts))

    @property
    def validation_limits(self) -> ValidationLimits:
        """What the upload check and the batch validation enforce on an input file."""
        return ValidationLimits(
            max_requests=self.max_requests_per_file,
            max_line_bytes=self.max_line_bytes,
            max_file_bytes=self.max_upload_bytes,
        )


def _parse(name: str, raw: str) -> Any:
    default = {f.name: f for f in dataclasses.fields(Settings)}[name].default
    if name in ("api_keys", "callback_allowed_hosts"):
        return tuple(item.strip() for item in raw.split(",") if item.strip())
    if name == "storage_dir":
        return Path(raw)
    if isinstance(default, bool):
        return raw.lower() in {"1", "true", "yes", "on"}
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return raw
