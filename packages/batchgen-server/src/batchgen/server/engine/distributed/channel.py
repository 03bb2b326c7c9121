"""The driver's commands to the worker ranks, broadcast as tensors over a group of their own: a fixed header, then
one int64 payload (for a step: the packed row's token ids, positions and cache slots, each sequence's slice, the
rows whose logits are kept, and the block-table rows the sequences name). Nothing is pickled per sequence; a step of
256 decodes is one header and one payload of a few kilobytes.

The channel's group waits as long as the driver is idle (a day); the model's own collectives run on the default
group with ``--distributed-timeout-s``."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..attention import SeqSlice
from ..inputs import PackedInputs

HEADER = 8
IDLE_TIMEOUT = timedelta(days=1)


class Command(enum.IntEnum):
    STEP = 1
    """Run the packed step's forward (``ModelRunner.forward``)."""
    REFERENCE = 2
    """Run the model's own forward over a row of tokens (the self-check's reference)."""
    STOP = 3


@dataclass(slots=True)
class Received:
    command: Command
    packed: PackedInputs | None = None
    sample_rows: list[int] | None = None
    want_hidden: bool = False
    tokens: torch.Tensor | None = None


class Channel:
    """Both ends: the driver (rank 0) sends, the others receive, in the same order. Created by every rank at once,
    after the default group (``new_group`` is collective)."""

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.device = device
        self.block_size = block_size

    def send_step(self, packed: PackedInputs, sample_rows: list[int], want_hidden: bool) -> None:
        seqs = packed.seqs
        bs_cols = max((-(-seq.end // self.block_size) for seq in seqs), default=0)
        rows = [seq.table_row for seq in seqs]
        tables = packed.block_tables[rows, :bs_cols] if seqs else np.zeros((0, 0), dtype=np.int64)
        slices = np.array([(seq.row, seq.num_tokens, seq.start) for seq in seqs], dtype=np.int64).reshape(-1)
        payload = torch.cat(
            [
                packed.input_ids.reshape(-1).to("cpu", torch.int64),
                packed.positions.reshape(-1).to("cpu", torch.int64),
                packed.slots.reshape(-1).to("cpu", torch.int64),
                torch.from_numpy(slices),
                torch.tensor(sample_rows, dtype=torch.int64),
                torch.from_numpy(np.ascontiguousarray(tables, dtype=np.int64)).reshape(-1),
            ]
        )
        header = [Command.STEP, packed.input_ids.numel(), len(seqs), len(sample_rows), int(want_hidden), bs_cols]
        self._send(header, payload)

    def send_reference(self, tokens: torch.Tensor) -> None:
        self._send([Command.REFERENCE, tokens.numel()], tokens.reshape(-1).to("cpu", torch.int64))

    def send_stop(self) -> None:
        self._send([Command.STOP], None)

    def _send(self, fields: list[int], payload: torch.Tensor | None) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[: len(fields)] = torch.tensor([int(field) for field in fields])
        header[-1] = 0 if payload is None else payload.numel()
        dist.broadcast(header, 0, group=self.group)
        if payload is not None and payload.numel():
            dist.broadcast(payload.contiguous(), 0, group=self.group)

    def receive(self) -> Received:
        header = torch.zeros(HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        fields = header.tolist()
        command, size = Command(fields[0]), fields[-1]
        payload = torch.empty(size, dtype=torch.int64)
        if size:
            dist.broadcast(payload, 0, group=self.group)
        if command is Command.REFERENCE:
            return Received(command, tokens=payload.to(self.device))
        if command is not Command.STEP:
            return Received(command)
        tokens, num_seqs, num_sample, want_hidden, cols = fields[1:6]
        parts = torch.split(payload, [tokens, tokens, tokens, 3 * num_seqs, num_sample, num_seqs * cols])
        ids, positions, slots = (part.to(self.device) for part in parts[:3])
        slices = parts[3].view(num_seqs, 3).tolist()
        seqs = [SeqSlice(row, count, start, index) for index, (row, count, start) in enumerate(slices)]
        tables = parts[5].view(num_seqs, cols).numpy()
        packed = PackedInputs(ids, positions, slots, seqs, tables)
        return Received(command, packed, parts[4].tolist(), bool(want_hidden))
