"""The engine that ``serve`` and ``run-batch`` drive: one inside this process (the default), or replicas on Ray
(``--replicas N``). Either is given to the batch loop the same way; Ray is imported only for replicas."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .batches.loop import Engine as LoopEngine
from .batches.loop import default_window
from .engine.errors import ModelLoadError

if TYPE_CHECKING:
    from batchgen.schemas import ReplicaStatus

    from .engine import EncoderEngine, EngineStats, LLMEngine
    from .engine.config import EngineConfig
    from .replicas.config import ClusterConfig
    from .replicas.pool import ReplicaPool

    Engine = LLMEngine | EncoderEngine | ReplicaPool


@runtime_checkable  # the server's context names it, and Litestar checks the context's fields
class EngineFront(LoopEngine, Protocol):
    """What the server needs of what steps the engine: an ``EngineWorker``, or the ``ReplicaPool``."""

    error: BaseException | None

    @property
    def state(self) -> str: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def restarts(self) -> int: ...

    def start(self) -> None: ...

    def stop(self, timeout: float | None = None) -> None: ...

    def stats(self) -> EngineStats: ...


def load_engine(config: EngineConfig, cluster: ClusterConfig) -> Engine:
    """The model loaded, in this process or on every replica; ``ModelLoadError`` (one line) if it cannot be."""
    if not cluster.replicas:
        from .engine import LLMEngine

        return LLMEngine.from_config(config)
    try:
        from .replicas.ray_cluster import start_pool
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        raise ModelLoadError(
            "--replicas runs the engine replicas on Ray, which is not installed: pip install 'batchgen-server[ray]'"
        ) from None
    return start_pool(config, cluster)


def worker_for(engine: Engine) -> EngineFront:
    """What the batch loop drives: the pool itself, or a worker thread stepping the in-process engine."""
    from .engine import EngineWorker
    from .replicas.pool import ReplicaPool

    return engine if isinstance(engine, ReplicaPool) else EngineWorker(engine)


def window_for(engine: Engine) -> int:
    """The batch loop's default window: a running set and a quarter more for each engine."""
    from .replicas.pool import ReplicaPool

    engines = engine.size if isinstance(engine, ReplicaPool) else 1
    return engines * default_window(engine.config.max_num_seqs)


def replica_states(front: EngineFront) -> list[ReplicaStatus] | None:
    """Each replica's state with ``--replicas``; ``None`` with the single in-process engine."""
    from .replicas.pool import ReplicaPool

    return front.replicas() if isinstance(front, ReplicaPool) else None
