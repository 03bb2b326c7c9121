"""How a group's worker ranks are started and watched (``--distributed-executor-backend``, vLLM's names): ``mp``, a
fresh interpreter each on this node (``python -m ...distributed.rank``), or ``ray``, a Ray actor each in a placement
group (``ray_ranks.py``, which alone imports Ray). The group sees either as a ``Launcher`` of ``RankHandle``s."""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import subprocess
import sys
import time
from typing import IO, Protocol

from ..config import EngineConfig
from ..errors import ModelLoadError


class RankHandle(Protocol):
    """A worker rank, as the driver watches it."""

    def ended(self) -> str | None:
        """``None`` while it runs; else how it ended, for messages: ``exited (signal 9)``."""
        ...

    def start_failure(self, deadline: float) -> str | None:
        """Its own one-line account of why it could not start, if it gives one before ``deadline`` (monotonic)."""
        ...

    def stop(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for it to go (told to by the driver), then kill it."""
        ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    host: str
    """Where the driver's meeting point is reached from the ranks."""

    def spawn(self, config: EngineConfig, rank: int, world: int, address: str) -> RankHandle: ...

    def close(self) -> None:
        """Every rank is gone: release what held their places (again: nothing)."""
        ...


def launcher_for(config: EngineConfig) -> Launcher:
    if config.distributed_executor_backend == "ray":
        try:
            from .ray_ranks import RayLauncher  # Ray imported for this backend only
        except ModuleNotFoundError as exc:
            if exc.name != "ray":
                raise
            raise ModelLoadError(
                "--distributed-executor-backend ray places the ranks with Ray, which is not installed: "
                "pip install 'batchgen-server[ray]'"
            ) from None
        return RayLauncher(config)
    return ProcessLauncher()


class ProcessLauncher:
    """``mp``: a process each, children of the driver's."""

    host = "127.0.0.1"

    def spawn(self, config: EngineConfig, rank: int, world: int, address: str) -> RankHandle:
        return ProcessRank(config, rank, world, address)

    def close(self) -> None:
        pass


class ProcessRank:
    """A worker rank in a fresh interpreter (no threads, CUDA state or ``__main__`` of the driver's); a pipe of its
    own carries its one line if it cannot start."""

    def __init__(self, config: EngineConfig, rank: int, world: int, address: str) -> None:
        read, write = os.pipe()
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        command = [sys.executable, "-m", __package__ + ".rank", str(rank), str(world), address, str(write)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=(write,), env=environment)
        os.close(write)
        self.report: IO[bytes] = os.fdopen(read, "rb")
        assert self.process.stdin is not None
        with self.process.stdin:
            pickle.dump(config, self.process.stdin)

    def ended(self) -> str | None:
        code = self.process.poll()
        if code is None:
            return None
        return f"exited (signal {-code})" if code < 0 else f"exited (code {code})"

    def start_failure(self, deadline: float) -> str | None:
        with contextlib.suppress(OSError, ValueError):
            ready, _, _ = select.select([self.report], [], [], max(0.0, deadline - time.monotonic()))
            if ready and (line := self.report.readline().decode(errors="replace").strip()):
                return line
        return None

    def stop(self, wait_s: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=wait_s)  # nothing of a rank's to keep
        self.kill()
        self.report.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
