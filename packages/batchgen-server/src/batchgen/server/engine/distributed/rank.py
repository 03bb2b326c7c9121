"""A rank of a tensor-parallel group: how every rank joins (the process group, the command channel, its shard of the
weights), and a worker rank's process, which then runs every forward the driver sends, on its shard and its heads'
share of the KV cache, until told to stop or the group breaks."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from ..config import EngineConfig
from ..features.state.step import StateStep
from ..loading.loader import load_model
from ..runner.model_runner import ModelRunner
from ..sampling.grammar import compiler_for
from ..self_check import reference_logits
from .channel import Channel, Command

logger = logging.getLogger(__name__)


START_TIMEOUT_S = 600.0
"""Longest the ranks may take to meet (a worker's interpreter starting, torch imported): the driver stops waiting as
soon as a worker exits, so only a rank that hangs while starting costs this."""


def join(
    config: EngineConfig,
    rank: int,
    world: int,
    address: str,
    await_ranks: Callable[[Any], None] | None = None,
    local_device: int | None = None,
) -> tuple[EngineConfig, PreTrainedModel, Any, Channel]:
    """Join the group at ``address`` as ``rank`` and load this rank's shard: every rank calls it at once (the
    driver, rank 0, hosts the meeting point and waits there with ``await_ranks``). Returns the rank's config (its own
    device on CUDA), its model shard, the tokenizer and the channel. ``local_device``: the CUDA device it takes (by
    default its rank: the node's devices in rank order; a Ray actor sees its own GPU alone, as 0)."""
    config.apply_torch_threads()
    device = config.resolved_device()
    local = rank if local_device is None else local_device
    if device.type == "cuda":  # one device per rank (CUDA_VISIBLE_DEVICES chooses which)
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        config = dataclasses.replace(config, device=str(device))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world))  # transformers' mesh reads them
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        host, int(port), world, is_master=rank == 0, timeout=timedelta(seconds=START_TIMEOUT_S), wait_for_workers=False
    )
    if rank:
        store.set(f"joined/{rank}", "1")
    elif await_ranks is not None:
        await_ranks(store)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=config.distributed_timeout_s),
    )
    channel = Channel(device, config.block_size)
    model, tokenizer = load_model(config)
    return config, model, tokenizer, channel


def one_line(exc: BaseException) -> str:
    text = next(iter(str(exc).strip().splitlines()), "")
    return text if text else type(exc).__name__


def start_rank(
    config: EngineConfig, rank: int, world: int, address: str, local_device: int | None = None
) -> tuple[ModelRunner, Channel]:
    """A worker rank's start: join, and build the runner alongside the driver's."""
    config, model, tokenizer, channel = join(config, rank, world, address, local_device=local_device)
    vocab = model.config.get_text_config().vocab_size
    return ModelRunner(model, config, compiler_for(tokenizer, vocab, config.grammar_timeout_s)), channel


def serve_rank(config: EngineConfig, rank: int, world: int, address: str, report: BinaryIO) -> None:
    """A worker rank's process (``--distributed-executor-backend mp``): start, then run the driver's commands. A
    failure to start is written to ``report`` in one line; a failure later ends the process, which the driver sees
    as a broken group."""
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(name)s: %(message)s")
    try:
        runner, channel = start_rank(config, rank, world, address)
    except BaseException as exc:  # whatever it is, the driver reports it in one line
        report.write(one_line(exc).encode() + b"\n")
        report.flush()
        sys.exit(1)
    report.close()
    try:
        serve(runner, channel)
    except Exception as exc:  # the driver went, or a collective failed: the driver restarts the group
        logger.warning("rank %d leaves the group: %s", rank, one_line(exc))
        sys.exit(1)


@torch.no_grad()
def serve(runner: ModelRunner, channel: Channel) -> None:
    """Run the driver's commands until it says stop (a failure raises: the group is broken)."""
    while True:
        received = channel.receive()
        if received.command is Command.STOP:
            dist.destroy_process_group()
            return
        if received.command is Command.COPY_BLOCK:
            runner.cache.copy_block(*received.blocks)
            continue
        if received.command is Command.COPY_STATE:
            assert runner.states is not None
            runner.states.cache.copy_slot(*received.blocks)
            continue
        lora = runner.lora
        if received.command is Command.ADAPTER:  # this rank's shard of it, read from its directory (then cached)
            assert lora is not None and received.adapter is not None
            lora.load(received.slot, received.adapter)
            continue
        if received.command is Command.REFERENCE:
            assert received.tokens is not None
            adapter = lora.weights(received.adapter) if lora is not None and received.adapter is not None else None
            with lora.referencing(adapter) if lora is not None else nullcontext():
                reference_logits(runner, received.tokens.unsqueeze(0))
            continue
        assert received.packed is not None and received.sample_rows is not None
        if lora is not None and received.adapter_slots is not None:
            lora.prepare(received.adapter_slots)
        packed = received.packed
        if received.state_layout is not None:  # the driver's layout, over this rank's own state cache
            assert runner.states is not None
            packed = dataclasses.replace(
                packed, states=runner.states.mixers.bind(StateStep.decoded(received.state_layout))
            )
        runner.forward(packed, received.sample_rows, received.want_hidden, received.images)


def _die_with_parent() -> None:
    """The rank goes within a second of the driver, however the driver goes (a parent-death signal would fire when
    the driver's thread that started the rank ends, which may be any thread of a pool)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="batchgen-rank-watchdog", daemon=True).start()


def main() -> None:
    """``python -m batchgen.server.engine.distributed.rank RANK WORLD ADDRESS REPORT_FD``, the config pickled on
    stdin: how the driver starts a worker rank (a fresh interpreter, no ``__main__`` of the driver's imported)."""
    rank, world, address, fd = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    config = pickle.load(sys.stdin.buffer)
    with os.fdopen(fd, "wb") as report:
        serve_rank(config, rank, world, address, report)


if __name__ == "__main__":
    main()
