"""Every setting of the server in one place: defaults here, overridden by ``BATCHGEN_*`` environment variables,
overridden by command-line flags (``cli.py`` builds its ``serve`` flags from these fields)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIB = 1024 * 1024


@dataclass(slots=True)
class Settings:
    model: str = "demo"
    """``demo`` (a tiny model built in code), a local directory or a Hugging Face hub id."""
    host: str = "127.0.0.1"
    port: int = 10900
    storage_dir: Path = Path("batchgen-data")
    """SQLite metadata (``batchgen.db``) and file contents (``blobs/``)."""
    api_keys: tuple[str, ...] = ()
    """Bearer keys accepted on ``/v1``; none configured means no authentication."""
    max_queued_requests: int = 100_000
    """Capacity: most requests waiting or running across all batches before ``POST /v1/batches`` answers 429."""
    retry_after_s: int = 30
    """``Retry-After`` sent with a 429."""
    max_upload_bytes: int = 200 * MIB
    max_requests_per_file: int = 50_000
    max_line_bytes: int = 8 * MIB
    flush_interval_s: float = 0.5
    """How often finished results are fsynced and the live counts published (at most once a second)."""
    engine: dict[str, Any] = field(default_factory=dict)
    """Extra ``EngineConfig`` fields (device, dtype, max_num_seqs, ...), passed through to the engine."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults, then ``BATCHGEN_<FIELD>`` variables, then ``overrides`` (those not ``None``)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f"BATCHGEN_{f.name.upper()}")
            if raw is not None and f.name != "engine":
                values[f.name] = _parse(f.name, raw)
        values.update({key: value for key, value in overrides.items() if value is not None})
        return cls(**values)

    @property
    def database_path(self) -> Path:
        return self.storage_dir / "batchgen.db"

    @property
    def blobs_dir(self) -> Path:
        return self.storage_dir / "blobs"


def _parse(name: str, raw: str) -> Any:
    default = {f.name: f for f in dataclasses.fields(Settings)}[name].default
    if name == "api_keys":
        return tuple(key.strip() for key in raw.split(",") if key.strip())
    if name == "storage_dir":
        return Path(raw)
    if isinstance(default, bool):
        return raw.lower() in {"1", "true", "yes", "on"}
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return raw
