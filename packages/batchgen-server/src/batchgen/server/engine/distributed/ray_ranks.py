"""``--distributed-executor-backend ray``: each worker rank a Ray actor, placed by a placement group with one bundle
per rank (one GPU each where the model runs on CUDA, else ``--torch-threads`` CPUs), packed onto as few nodes as hold
them (vLLM's default: a tensor-parallel group wants one node; pipeline stages may span nodes). The driver stays in
the server's process, outside the group's bundles. The Ray it joins: ``RAY_ADDRESS`` (Ray's own variable, as
``ray`` commands read it), else this process's connection, else a private local Ray, ended with the group."""

from __future__ import annotations

import os
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..config import EngineConfig
from ..errors import ModelLoadError
from .rank import one_line, serve, start_rank

PLACED_S = 60.0
"""Longest the group waits for Ray to find room for its ranks before it says the cluster cannot hold them."""
FORWARDED_ENVIRON = ("BATCHGEN_", "HF_")
"""Variables of the server's passed to each rank and each replica: the demo model's cache, the hub's token and cache."""


def forwarded_environ() -> dict[str, str]:
    """This process's ``FORWARDED_ENVIRON`` variables, for an actor to set in its own."""
    return {name: value for name, value in os.environ.items() if name.startswith(FORWARDED_ENVIRON)}


class RankActor:
    """A worker rank in a Ray worker process."""

    def run(self, config: EngineConfig, rank: int, world: int, address: str, environ: dict[str, str]) -> str | None:
        """Start (the one-line reason it could not, returned), then serve the driver's commands until told to stop;
        a failure while serving raises, which the driver sees as the rank's end."""
        os.environ.update(environ)
        local = 0 if config.resolved_device().type == "cuda" else None  # Ray shows the actor its own GPU alone
        try:
            runner, channel = start_rank(config, rank, world, address, local_device=local)
        except BaseException as exc:
            return one_line(exc)
        serve(runner, channel)
        return None

    def pid(self) -> int:
        return os.getpid()


class RayLauncher:
    def __init__(self, config: EngineConfig) -> None:
        self.started = False
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or "local"
            try:
                ray.init(address=address, include_dashboard=False if address == "local" else None)
            except Exception as exc:
                raise ModelLoadError(
                    f"--distributed-executor-backend ray: no Ray at {address}: {one_line(exc)}"
                ) from exc
            self.started = True
        self.host: str = ray.util.get_node_ip_address()
        on_gpu = config.resolved_device().type == "cuda"
        self.bundle = {"GPU": 1.0, "CPU": 1.0} if on_gpu else {"CPU": float(config.torch_threads or 1)}
        workers = config.world_size - 1
        self.group: PlacementGroup | None = placement_group([dict(self.bundle)] * workers, strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=PLACED_S)
        except GetTimeoutError:
            self.close()
            need = ", ".join(f"{amount * workers:g} {name}s" for name, amount in self.bundle.items())
            raise ModelLoadError(
                f"--distributed-executor-backend ray: the Ray cluster has no room for {workers} ranks ({need}) "
                f"within {PLACED_S:.0f} s"
            ) from None

    def spawn(self, config: EngineConfig, rank: int, world: int, address: str) -> RayRank:
        assert self.group is not None
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank - 1)
        resources = {"num_gpus": self.bundle.get("GPU", 0), "num_cpus": self.bundle["CPU"]}
        # Two calls at once: ``run`` lasts as long as the group, and ``pid`` may be asked meanwhile.
        options = {"scheduling_strategy": strategy, "max_restarts": 0, "max_concurrency": 2, **resources}
        actor: Any = ray.remote(RankActor).options(**options).remote()
        return RayRank(actor, actor.run.remote(config, rank, world, address, forwarded_environ()))

    def close(self) -> None:
        if self.group is None:
            return
        group, self.group = self.group, None
        remove_placement_group(group)
        if self.started:
            ray.shutdown()


class RayRank:
    def __init__(self, actor: Any, running: ray.ObjectRef[str | None]) -> None:
        self.actor = actor
        self.running = running

    def _done(self, timeout: float) -> bool:
        ready, _ = ray.wait([self.running], timeout=max(0.0, timeout))
        return bool(ready)

    def ended(self) -> str | None:
        if not self._done(0):
            return None
        try:
            ray.get(self.running)
        except RayError as exc:
            return f"ended (its Ray actor: {one_line(exc)})"
        return "ended (its Ray actor returned)"

    def start_failure(self, deadline: float) -> str | None:
        if not self._done(deadline - time.monotonic()):
            return None
        try:
            line: str | None = ray.get(self.running)
        except RayError:
            return None
        return line

    def stop(self, wait_s: float) -> None:
        self._done(wait_s)
        self.kill()

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)
