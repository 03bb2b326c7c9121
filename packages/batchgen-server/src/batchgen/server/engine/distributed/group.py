"""The driver's side of a tensor-parallel group: the worker ranks started (one process each, ``rank.py``), every
forward the driver runs sent to them first (``channel.py``), and the group declared dead when a rank dies or a
mirrored forward fails, then started again whole (the engine worker's restart: ``LLMEngine.reset``)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from ..config import EngineConfig
from ..errors import GroupFailed, ModelLoadError
from ..features.adapters import LoRARequest
from ..features.multimodal.vision_step import StepImages
from ..loading.loader import resolve_model_path
from ..loading.split import check_split
from ..runner.inputs import PackedInputs
from ..runner.model_runner import ModelRunner
from ..sampling.grammar import GrammarCompiler
from .channel import Channel
from .launch import Launcher, RankHandle, launcher_for
from .rank import START_TIMEOUT_S, join, one_line

logger = logging.getLogger(__name__)

REPORT_WAIT_S = 3.0
"""How long a failed start waits for the ranks' own account of why."""
NAME_THE_DEAD_S = 1.0
"""How long a failed collective waits to see which rank exited (none: a rank hung, or the driver failed)."""


class RankGroup:
    """The driver (rank 0, this process) and its worker ranks. ``StepMirror`` for the driver's ``ModelRunner``."""

    def __init__(self, config: EngineConfig, launcher: Launcher) -> None:
        self.config = config
        self.size = config.world_size
        self.kind = kind_of(config)
        self.launcher = launcher
        self.address = f"{launcher.host}:{_free_port()}"
        self.processes: list[RankHandle] = []
        """The worker ranks, 1..size-1 in order."""
        self.channel: Channel | None = None
        self._failed = False

    @classmethod
    def start(cls, config: EngineConfig) -> tuple[RankGroup, PreTrainedModel, Any]:
        """Start the worker ranks, join them as rank 0 and load this rank's shard: the group, the driver's shard and
        the tokenizer. ``ModelLoadError`` in one line if any rank cannot start (the others are stopped)."""
        check_split(config, resolve_model_path(config.model))
        if dist.is_initialized():
            raise ModelLoadError("a distributed group: this process drives one already (one per process)")
        group = cls(config, launcher_for(config))
        atexit.register(group.stop)  # the ranks told to go when this process ends normally (their watchdog otherwise)
        with group.starting():
            for rank in range(1, group.size):
                group.processes.append(group.launcher.spawn(config, rank, group.size, group.address))
            _, model, tokenizer, group.channel = join(config, 0, group.size, group.address, group._await_ranks)
        return group, model, tokenizer

    def _await_ranks(self, store: Any) -> None:
        """Until every worker rank has joined; raises as soon as one has exited instead."""
        keys = [f"joined/{rank}" for rank in range(1, self.size)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not store.check(keys):
            if any(process.ended() is not None for process in self.processes):
                raise RuntimeError("a rank exited before it joined")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the ranks did not meet within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Whatever fails in here (the driver's start, the runner's first collectives, the self-check) stops the
        group; the error says which rank could not start and why, in one line."""
        try:
            yield
        except BaseException as exc:
            why = self._why_not_started(exc)
            self.stop()
            if isinstance(exc, ModelLoadError) and why is None:
                raise
            raise ModelLoadError(why or f"the {self.kind} group could not start: {one_line(exc)}") from exc

    def _why_not_started(self, exc: BaseException) -> str | None:
        deadline = time.monotonic() + REPORT_WAIT_S
        for rank, process in enumerate(self.processes, start=1):
            if line := process.start_failure(deadline):
                return f"rank {rank} of {self.size} could not start: {line}"
        for rank, process in enumerate(self.processes, start=1):
            if (ended := process.ended()) is not None:
                return f"rank {rank} of {self.size} could not start: it {ended}"
        return None

    # ---- StepMirror ------------------------------------------------------------------------------------------------

    @property
    def broken(self) -> bool:
        return self._failed or any(process.ended() is not None for process in self.processes)

    def send_step(
        self,
        packed: PackedInputs,
        sample_rows: list[int],
        want_hidden: bool,
        adapter_slots: list[int] | None = None,
        images: StepImages | None = None,
    ) -> None:
        assert self.channel is not None
        if self.broken:
            raise self.failed(RuntimeError("a rank is gone"))
        self.channel.send_step(packed, sample_rows, want_hidden, adapter_slots, images)

    def send_reference(self, tokens: torch.Tensor, adapter: LoRARequest | None = None) -> None:
        assert self.channel is not None
        self.channel.send_reference(tokens, adapter)

    def send_adapter(self, slot: int, adapter: LoRARequest) -> None:
        """An adapter copied into a slot on the driver: into the same slot on every rank (each its own shard)."""
        self._mirrored(lambda channel: channel.send_adapter(slot, adapter))

    def send_copy_block(self, src: int, dst: int) -> None:
        """A block copied on the driver (a fork's): on every rank too, each its own share of it."""
        self._mirrored(lambda channel: channel.send_copy_block(src, dst))

    def send_copy_state(self, src: int, dst: int) -> None:
        """A state slot copied on the driver: on every rank too (each its share of the slot)."""
        self._mirrored(lambda channel: channel.send_copy_state(src, dst))

    def _mirrored(self, send: Callable[[Channel], None]) -> None:
        assert self.channel is not None
        try:
            if self.broken:
                raise RuntimeError("a rank is gone")
            send(self.channel)
        except Exception as exc:
            raise self.failed(exc) from exc

    def failed(self, exc: BaseException) -> GroupFailed:
        if isinstance(exc, GroupFailed):
            return exc
        self._failed = True
        deadline = time.monotonic() + NAME_THE_DEAD_S  # a peer's socket closes a moment before its exit is seen
        while not (gone := self._gone()) and time.monotonic() < deadline:
            time.sleep(0.01)
        why = "; ".join(gone) if gone else one_line(exc)
        return GroupFailed(f"the {self.kind} group of {self.size} ranks failed: {why}")

    def _gone(self) -> list[str]:
        return [
            f"rank {rank} {ended}"
            for rank, process in enumerate(self.processes, start=1)
            if (ended := process.ended()) is not None
        ]

    def restarted(self, grammars: GrammarCompiler) -> ModelRunner:
        logger.warning("restarting the %s group of %d ranks", self.kind, self.size)
        self.stop()
        began = time.monotonic()
        group, model, _ = RankGroup.start(self.config)
        with group.starting():
            runner = ModelRunner(model, self.config, grammars, group)
        logger.warning("the %s group is back after %.1f s", self.kind, time.monotonic() - began)
        return runner

    # ---- the end ---------------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every worker rank (asked first if the group still works, killed if it does not go) and leave the
        process group, so another can start."""
        if self.channel is not None and not self.broken:
            with contextlib.suppress(Exception):
                self.channel.send_stop()
        for process in self.processes:
            process.stop(1.0 if not self._failed else 0.2)
        self.launcher.close()
        self.processes = []
        self._failed = True
        atexit.unregister(self.stop)  # a restarted group registers its own
        self.channel = None
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def kind_of(config: EngineConfig) -> str:
    """What the group splits, for messages: the TP ranks of each stage, or the stages, or both."""
    if config.pipeline_parallel_size == 1:
        return "tensor-parallel"
    return "pipeline-parallel" if config.tensor_parallel_size == 1 else "tensor- and pipeline-parallel"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
