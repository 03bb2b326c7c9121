"""Health and pool-status objects (``/health``, ``/v1/pool/status``)."""

from __future__ import annotations

from typing import Literal

from ._base import Wire


class HealthStatus(Wire, kw_only=True):
    status: Literal["healthy", "unhealthy"]
    reason: str | None = None
    model: str | None = None


class PoolStatus(Wire, kw_only=True):
    object: Literal["pool.status"] = "pool.status"
    queued_requests: int
    """Work accepted and not yet running, in sequences (prompts x n)."""
    running_requests: int
    """Sequences the engine is running."""
    capacity: int
    """Most sequences the server accepts into its queue before ``POST /v1/batches`` answers 429."""
    active_batches: int
    kv_blocks_total: int
    kv_blocks_free: int
    prompt_tokens: int = 0
    """Prompt tokens the engine has processed since the server started (a counter: its rate is the throughput)."""
    generated_tokens: int = 0
    """Tokens the engine has generated since the server started (a counter)."""
    storage_fault: str | None = None
    """Why batch results cannot be written now (a full disk...): batches are paused and resume by themselves."""
