"""The replica settings, declared once (``options.setting``): shared by ``serve`` and ``run-batch``."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import setting


@dataclass(slots=True)
class ClusterConfig:
    replicas: int = setting(
        0,
        "engine replicas to run as Ray actors, one GPU each where the Ray cluster has GPUs, else one process each "
        "(0: one engine inside this process, and Ray is not used)",
    )
    ray_address: str | None = setting(
        None,
        "join the Ray cluster at this address (its head's host:port, or 'auto' for the one started on this machine "
        "with `ray start`) so that replicas run on its nodes (default: start a private local Ray)",
    )

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"--replicas {self.replicas}: give 0 (one engine in this process) or more")
        if self.ray_address and not self.replicas:
            raise ValueError("--ray-address places engine replicas on a Ray cluster: give --replicas N too")
