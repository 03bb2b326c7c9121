"""Every setting of the server, each declared once (``options.setting``): its flag, its ``BATCHGEN_*`` variable, its
default and its help text. The engine's knobs are declared the same way in ``engine/config.py``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgen.schemas.validation import ValidationLimits

from .engine.config import EngineConfig
from .options import build, setting
from .replicas.config import ClusterConfig
from .serving.config import ServingConfig

if TYPE_CHECKING:
    from .callbacks import CallbackSettings

MIB = 1024 * 1024


def default_storage_dir() -> Path:
    """``$XDG_DATA_HOME/batchgen``, or ``~/.local/share/batchgen``: never inside the directory the server starts in."""
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "batchgen"


@dataclass(slots=True)
class Settings:
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(10900, "port to listen on")
    storage_dir: Path = setting(  # noqa: RUF009 (a dataclass field with a default_factory, not a shared default)
        default_factory=default_storage_dir,
        help="SQLite metadata (batchgen.db) and file contents (blobs/)",
        flags=("--storage", "--storage-dir"),
    )
    api_keys: tuple[str, ...] = setting(
        (), "accepted Bearer key, repeat for several; none: no authentication, loopback only", flags=("--api-key",)
    )
    admin_api_key: str | None = setting(
        None,
        "the operator's Bearer key: with API keys set, only it may load and unload LoRA adapters at run time (it "
        "is a tenant of its own for everything else)",
    )
    insecure: bool = setting(False, "allow a non-loopback --host without an API key (a trusted network)")
    callback_allowed_hosts: tuple[str, ...] = setting(
        (),
        "host completion callbacks may reach, exact name or IP, repeat for several; none: callbacks off",
        flags=("--callback-allowed-host",),
    )
    max_connections: int | None = setting(
        None,
        "most HTTP connections held at once; past it a new one replaces the one idle the longest, or gets 503 if all "
        "are busy (default: the descriptor limit, raised to the hard limit, less a quarter)",
    )
    request_start_timeout_s: float = setting(
        15.0, "a connection that sends no whole request head for this long after opening or its last answer is closed"
    )
    shutdown_timeout_s: float = setting(
        30.0, "after SIGTERM, requests in flight, the engine and the batch loop stop within this many seconds"
    )
    file_sweep_interval_s: float = setting(60.0, "how often files past their expires_at are deleted (also at startup)")
    max_queued_requests: int = setting(
        100_000, "capacity in sequences (prompts x n) of all unfinished batches; POST /v1/batches answers 429 above it"
    )
    max_line_sequences: int = setting(
        256, "most sequences (prompts x n) one request may ask for; a line over it gets an error line"
    )
    engine_window: int | None = setting(
        None,
        "most sequences the batch loop keeps inside the engine, all replicas together "
        "(default: 1.25 x --max-num-seqs for each replica)",
    )
    max_online_sequences: int | None = setting(
        None,
        "most sequences (prompts x n) of online requests inside the engine at once; more answer 429 "
        "(default: 2 x --max-num-seqs)",
    )
    max_stream_backlog_tokens: int = setting(
        65536, "generated tokens a streamed request's reader may leave unread; past it the request is stopped"
    )
    retry_after_s: int = setting(30, "Retry-After of a 429")
    max_upload_bytes: int = setting(200 * MIB, "largest uploaded file (413 above)")
    max_online_body_bytes: int = setting(
        4 * MIB, "largest body of an online request (chat, completions, embeddings; 413 above): a batch takes more"
    )
    max_requests_per_file: int = setting(50_000, "most requests in one input file")
    max_line_bytes: int = setting(8 * MIB, "longest input line")
    upload_idle_timeout_s: float = setting(60.0, "an upload that sends nothing for this long is dropped (408)")
    flush_interval_s: float = setting(0.5, "how often results are fsynced and the live counts published (at most 1 s)")
    window_hour_s: float = setting(3600.0, "seconds in one hour of a completion_window (tests shrink time with it)")
    log_level: str = setting("info", "critical, error, warning, info or debug")
    log_format: str = setting("text", "text (one readable line per event) or json (one JSON object per line)")
    log_interval_s: float = setting(
        10.0, "seconds between the activity lines logged while the engine is busy (0: none)"
    )
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The model and the engine's knobs (their own flags and variables)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Engine replicas on Ray, if any (their own flags and variables)."""
    serving: ServingConfig = field(default_factory=ServingConfig)
    """How chat outputs are read: tool-call and reasoning parsers (their own flags and variables)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults, then ``BATCHGEN_*`` variables (the engine's, the replicas' and the serving's too), then
        ``overrides``."""
        nested: dict[str, Any] = {
            "engine": build(EngineConfig, environ=environ),
            "cluster": build(ClusterConfig, environ=environ),
            "serving": build(ServingConfig, environ=environ),
        }
        settings = build(cls, environ=environ, **nested)
        for name, value in overrides.items():
            setattr(settings, name, value)
        return settings

    @property
    def accepted_keys(self) -> tuple[str, ...]:
        """Every Bearer key the server accepts: the tenants' and the operator's."""
        return self.api_keys + ((self.admin_api_key,) if self.admin_api_key else ())

    @property
    def database_path(self) -> Path:
        return self.storage_dir / "batchgen.db"

    @property
    def blobs_dir(self) -> Path:
        return self.storage_dir / "blobs"

    @property
    def callbacks(self) -> CallbackSettings:
        from .callbacks import CallbackSettings  # httpx: not imported by --help

        return CallbackSettings(allowed_hosts=frozenset(self.callback_allowed_hosts))

    @property
    def validation_limits(self) -> ValidationLimits:
        """What the upload check and the batch validation enforce on an input file."""
        return ValidationLimits(
            max_requests=self.max_requests_per_file,
            max_line_bytes=self.max_line_bytes,
            max_file_bytes=self.max_upload_bytes,
        )
