"""Start engine replicas as Ray actors and reach them: the only module that imports Ray (``--replicas`` only).

Each replica is a ``Replica`` actor: one GPU where the cluster has GPUs, else ``--torch-threads`` CPUs (1 by
default), spread over the nodes. Ray restarts a replica whose process or node dies (without limit: a server runs
for months); the pool sees a new incarnation and sends its requests again.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayError

from ..engine.config import EngineConfig
from ..engine.distributed.ray_ranks import forwarded_environ
from ..engine.errors import ModelLoadError
from ..engine.request import EngineRequest
from .config import ClusterConfig
from .pool import ReplicaHandle, ReplicaLost, ReplicaPool
from .replica import ModelInfo, Replica, Report

POLL_S = 0.5
"""The longest a replica waits for a result before it answers a poll anyway (with its stats)."""
LATE_S = 5.0
"""How much later than that an answer may come before the pool looks again (it keeps waiting for that answer)."""
CONCURRENCY = 4
"""Calls one replica runs at once: a poll waits while submits and aborts come in."""


def start_pool(config: EngineConfig, cluster: ClusterConfig) -> ReplicaPool:
    """``cluster.replicas`` replicas of ``config``'s model, loaded (``ModelLoadError`` in one line if one cannot
    load it, or the cluster cannot hold them); a private local Ray is started unless ``cluster.ray_address`` names
    one, or this process is connected to one already."""
    on_gpu = config.device.startswith("cuda") if config.device else None
    ranks = config.world_size  # a replica holding a split model runs its group's ranks: it reserves them all
    cpus = (config.torch_threads or 1) * ranks
    started = _connect(cluster, cpus if not on_gpu else 0)
    actors: list[ray.actor.ActorHandle[Replica]] = []
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        on_gpu = on_gpu if on_gpu is not None else gpus > 0
        resources = {"num_gpus": ranks} if on_gpu else {"num_cpus": cpus}
        _check_room(cluster.replicas, resources)
        # Ray types an actor class's options() as the class itself: its actors are ActorHandles.
        actor_class: Any = ray.remote(Replica).options(
            max_restarts=-1,
            max_task_retries=0,
            max_concurrency=CONCURRENCY,
            scheduling_strategy="SPREAD",
            **resources,
        )
        device = "cuda" if on_gpu else config.device  # Ray shows each GPU replica its own GPUs only, from cuda:0
        environ = forwarded_environ()
        for index in range(cluster.replicas):
            replica_config = dataclasses.replace(config, device=device, seed=config.seed + index)
            actors.append(actor_class.remote(replica_config, environ))
        described: list[ModelInfo | str] = ray.get([actor.describe.remote() for actor in actors])
        for index, model in enumerate(described):
            if isinstance(model, str):
                raise ModelLoadError(model if cluster.replicas == 1 else f"replica {index}: {model}")
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if started:
            ray.shutdown()
        raise
    assert isinstance(described[0], ModelInfo)
    handles: list[ReplicaHandle] = [RayReplica(actor) for actor in actors]
    return ReplicaPool(handles, described[0], config, on_stop=ray.shutdown if started else lambda: None)


def _connect(cluster: ClusterConfig, cpus_per_replica: int) -> bool:
    """Connect to Ray; ``True`` if this started it (and so ends it)."""
    if ray.is_initialized():
        return False
    try:
        if cluster.ray_address:
            ray.init(address=cluster.ray_address)
            return True
        # A private local Ray with room for every replica asked for, even on fewer cores (the user's choice).
        room = max(os.cpu_count() or 1, cluster.replicas * cpus_per_replica)
        ray.init(address="local", num_cpus=room, include_dashboard=False)
    except Exception as exc:
        where = f"the Ray cluster at {cluster.ray_address}" if cluster.ray_address else "a local Ray"
        raise ModelLoadError(f"cannot start the replicas: {where} could not be reached or started: {exc}") from exc
    return True


def _check_room(replicas: int, resources: dict[str, int]) -> None:
    """Refuse at once what the cluster cannot hold (Ray would wait forever for the resources)."""
    total = ray.cluster_resources()
    for resource, each in resources.items():
        name = "GPU" if resource == "num_gpus" else "CPU"
        have = total.get(name, 0)
        if have < replicas * each:
            raise ModelLoadError(
                f"{replicas} replicas need {replicas * each} {name}s ({each} each) and the Ray cluster has {have:g}: "
                "ask for fewer replicas, or add nodes" + (" or lower --torch-threads" if name == "CPU" else "")
            )


class RayReplica:
    """A ``Replica`` actor, as the pool reaches it (``pool.ReplicaHandle``)."""

    def __init__(self, actor: ray.actor.ActorHandle[Replica]) -> None:
        self._actor = actor
        self._lock = threading.Lock()
        self._sent: list[ray.ObjectRef[Any]] = []
        """Submits and aborts not known to have arrived: ``poll`` checks them."""
        self._poll: ray.ObjectRef[Report] | None = None
        """The poll awaited. Never abandoned for a new one: its answer may carry results taken from the outbox."""

    def submit(self, requests: list[EngineRequest]) -> None:
        self._send(self._actor.submit.remote(requests))

    def abort(self, request_ids: list[str]) -> None:
        self._send(self._actor.abort.remote(request_ids))

    def poll(self) -> Report | None:
        self._check_sent()
        if self._poll is None:
            self._poll = self._actor.poll.remote(POLL_S)
        try:
            report: Report = ray.get(self._poll, timeout=POLL_S + LATE_S)
        except GetTimeoutError:
            return None
        except RayError as exc:
            self._poll = None
            raise _lost(exc) from exc
        self._poll = None
        return report

    def restart(self) -> None:
        ray.kill(self._actor, no_restart=False)

    def kill(self) -> None:
        ray.kill(self._actor, no_restart=True)

    def _send(self, ref: ray.ObjectRef[Any]) -> None:
        with self._lock:
            self._sent.append(ref)

    def _check_sent(self) -> None:
        """``ReplicaLost`` if a submit or an abort failed (the requests it carried would never be answered)."""
        with self._lock:
            sent, self._sent = self._sent, []
        if not sent:
            return
        arrived, waiting = ray.wait(sent, num_returns=len(sent), timeout=0)
        with self._lock:
            self._sent.extend(waiting)
        try:
            ray.get(arrived)
        except RayError as exc:
            raise _lost(exc) from exc


def _lost(exc: RayError) -> ReplicaLost:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ReplicaLost(message, dead=isinstance(exc, ActorDiedError))
