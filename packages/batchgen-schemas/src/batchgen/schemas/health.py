"""Health and pool-status objects (``/health``, ``/v1/pool/status``)."""

from __future__ import annotations

from typing import Literal

from ._base import Wire

ReplicaState = Literal["starting", "running", "restarting", "dead"]


class ReplicaStatus(Wire, kw_only=True):
    """One engine replica of a server started with ``--replicas`` (a Ray actor, one GPU each where there are GPUs)."""

    index: int
    state: ReplicaState
    """``starting`` (loading the model), ``running``, ``restarting`` (its engine or its process is being replaced;
    its requests went to the other replicas) or ``dead`` (it gave up; its requests went to the others)."""
    node: str | None = None
    """Host name of the machine it runs on (``None`` until it has answered)."""
    pid: int | None = None
    assigned_requests: int = 0
    """Sequences (prompts x n) dispatched to it and not answered yet: running there or queued there."""
    running_requests: int = 0
    """Sequences its engine is running, as it last reported."""
    served_requests: int = 0
    """Results it returned since the server started (one per prompt of a request line)."""
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    restarts: int = 0
    """Times its process was replaced (Ray restarts a replica whose process or node died)."""
    error: str | None = None
    """Its last failure, if any (kept after it recovered, for the record)."""


class KVCacheCapacity(Wire, kw_only=True):
    """The KV cache the engine holds (all replicas together with ``--replicas``)."""

    dtype: str
    """``bfloat16``, ``float16``, ``float32``...: ``--kv-cache-dtype``, or the model's."""
    tokens: int
    """Tokens it holds: its blocks times the block size."""
    blocks: int
    bytes: int
    """Its memory: every layer's K and V."""
    state_slots: int = 0
    """Models with state layers (Mamba, linear attention, short convolutions): the state cache beside it, in the same
    memory budget: its slots (one per running sequence, and the prefix checkpoints), the checkpoints held, what one
    sequence's state costs and the whole state cache's bytes."""
    state_checkpoints: int = 0
    state_bytes_per_sequence: int = 0
    state_bytes: int = 0


class HealthStatus(Wire, kw_only=True):
    status: Literal["healthy", "unhealthy"]
    reason: str | None = None
    model: str | None = None
    kv_cache: KVCacheCapacity | None = None
    """``None`` for an engine with no KV cache (an encoder's)."""
    replicas: list[ReplicaStatus] | None = None
    """Each engine replica's state with ``--replicas``; ``None`` with the single in-process engine."""


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
    replicas: list[ReplicaStatus] | None = None
    """Each engine replica with ``--replicas`` (the other fields are their sums); ``None`` with one in-process
    engine."""
