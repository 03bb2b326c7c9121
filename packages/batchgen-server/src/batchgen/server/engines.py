"""The engine that ``serve`` and ``run-batch`` drive: one inside this process (the default), or replicas on Ray
(``--replicas N``). Either is an ``EngineClient``, given to the batch loop and the API the same way; Ray is
imported only for replicas."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .batches.loop import default_window
from .engine.errors import ModelLoadError

if TYPE_CHECKING:
    from batchgen.schemas import ReplicaStatus

    from .engine import EngineClient
    from .engine.config import EngineConfig
    from .replicas.config import ClusterConfig


def load_engine(config: EngineConfig, cluster: ClusterConfig) -> EngineClient:
    """The model loaded, in this process (behind a worker thread) or on every replica; ``ModelLoadError`` (one
    line) if it cannot be."""
    if cluster.replicas and config.world_size > 1 and config.distributed_executor_backend == "ray":
        raise ModelLoadError(
            f"--replicas with {config.split_flags} --distributed-executor-backend ray: each replica starts its "
            "group's ranks as its own processes, on the devices Ray gives it; drop --distributed-executor-backend"
        )
    if not cluster.replicas:
        from .engine import EngineWorker, build_engine

        return EngineWorker(build_engine(config))
    try:
        from .replicas.ray_cluster import start_pool
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        raise ModelLoadError(
            "--replicas runs the engine replicas on Ray, which is not installed: pip install 'batchgen-server[ray]'"
        ) from None
    pool = start_pool(config, cluster)
    # This process loads no model, yet the app's threads reach transformers' classes (the serving's generation
    # config, the tokenizer's): transformers imports them lazily, and two threads importing one at once can fail
    # ("Could not import module 'PreTrainedModel'"). Import them now, in this thread, before any other starts.
    from .engine.loading import loader  # noqa: F401

    return pool


def window_for(engine: EngineClient) -> int:
    """The batch loop's default window: a running set and a quarter more for each engine."""
    return engine.engines * default_window(engine.config.max_num_seqs)


def replica_states(engine: EngineClient) -> list[ReplicaStatus] | None:
    """Each replica's state with ``--replicas``; ``None`` with the single in-process engine."""
    from .replicas.pool import ReplicaPool

    return engine.replicas() if isinstance(engine, ReplicaPool) else None
