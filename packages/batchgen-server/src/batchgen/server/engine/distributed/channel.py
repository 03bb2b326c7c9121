"""The driver's commands to the worker ranks, broadcast as tensors over a group of their own: a fixed header, then
one int64 payload (for a step: the packed row's token ids, positions and cache slots, each sequence's slice, the
rows whose logits are kept, the block-table rows the sequences name, a vision-language step's image rows and M-RoPE
positions, and a hybrid model's state layout: ``StateStep.encoded``), then, for a step with images, their encoder
rows (float32). Nothing is pickled per sequence; a step of 256 decodes is one header and one payload of a few
kilobytes.

The channel's group waits as long as the driver is idle (a day); the model's own collectives run on the default
group with ``--distributed-timeout-s``."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..attention import SeqSlice
from ..features.adapters import LoRARequest
from ..features.multimodal.vision_step import StepImages
from ..runner.inputs import PackedInputs

HEADER = 16
IDLE_TIMEOUT = timedelta(days=1)


class Command(enum.IntEnum):
    STEP = 1
    """Run the packed step's forward (``ModelRunner.forward``)."""
    REFERENCE = 2
    """Run the model's own forward over a row of tokens (the self-check's reference)."""
    STOP = 3
    ADAPTER = 4
    """Copy an adapter into a LoRA slot (each rank its own shard of it: ``LoRASlots.load``)."""
    COPY_BLOCK = 5
    """Copy a KV block into another (a fork's partly filled block: each rank its own heads' and layers' share)."""
    COPY_STATE = 6
    """Copy a state slot into another (a fork's, a prefix checkpoint's restored): each rank its share of it."""


@dataclass(slots=True)
class Received:
    command: Command
    packed: PackedInputs | None = None
    sample_rows: list[int] | None = None
    want_hidden: bool = False
    tokens: torch.Tensor | None = None
    adapter_slots: list[int] | None = None
    """Each packed token's LoRA slot, with LoRA on."""
    images: StepImages | None = None
    """A vision-language step's image rows and positions, encoded by the driver."""
    state_layout: list[int] | None = None
    """A hybrid model's state step (``StateStep.encoded``)."""
    adapter: LoRARequest | None = None
    """The adapter of an ADAPTER command, or the one a REFERENCE runs with."""
    slot: int = 0
    blocks: tuple[int, int] = (0, 0)
    """A COPY_BLOCK's (or a COPY_STATE's) source and destination."""


class Channel:
    """Both ends: the driver (rank 0) sends, the others receive, in the same order. Created by every rank at once,
    after the default group (``new_group`` is collective)."""

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.device = device
        self.block_size = block_size

    def send_step(
        self,
        packed: PackedInputs,
        sample_rows: list[int],
        want_hidden: bool,
        adapter_slots: list[int] | None = None,
        images: StepImages | None = None,
    ) -> None:
        seqs = packed.seqs
        layout = packed.states.encoded() if packed.states is not None else []
        bs_cols = max((-(-seq.end // self.block_size) for seq in seqs), default=0)
        rows = [seq.table_row for seq in seqs]
        tables = packed.block_tables[rows, :bs_cols] if seqs else np.zeros((0, 0), dtype=np.int64)
        slices = np.array([(seq.row, seq.num_tokens, seq.start) for seq in seqs], dtype=np.int64).reshape(-1)
        spans = [len(seq.spans) for seq in seqs] if any(seq.spans for seq in seqs) else []  # each's, then their ends
        spans += [end for seq in seqs for span in seq.spans for end in span]
        payload = torch.cat(
            [
                packed.input_ids.reshape(-1).to("cpu", torch.int64),
                packed.positions.reshape(-1).to("cpu", torch.int64),
                packed.slots.reshape(-1).to("cpu", torch.int64),
                torch.from_numpy(slices),
                torch.tensor(sample_rows, dtype=torch.int64),
                torch.from_numpy(np.ascontiguousarray(tables, dtype=np.int64)).reshape(-1),
                torch.tensor(adapter_slots or [], dtype=torch.int64),
                *_image_parts(images),
                torch.tensor(layout, dtype=torch.int64),
                torch.tensor(spans, dtype=torch.int64),
            ]
        )
        header = [Command.STEP, packed.input_ids.numel(), len(seqs), len(sample_rows), int(want_hidden), bs_cols]
        image_rows = images.rows if images is not None else None
        features = images.features if images is not None else None
        image_fields = [
            images is not None,
            0 if image_rows is None else image_rows.numel(),
            0 if features is None else features.shape[1],
            images is not None and images.positions is not None,
        ]
        fields = [*header, adapter_slots is not None, *image_fields, packed.states is not None, len(layout), len(spans)]
        self._send(fields, payload)
        if features is not None:  # float32 whatever the model's dtype (bf16 and fp16 are exact in it)
            dist.broadcast(features.to("cpu", torch.float32).contiguous(), 0, group=self.group)

    def send_reference(self, tokens: torch.Tensor, adapter: LoRARequest | None = None) -> None:
        named = _encoded(adapter)
        payload = torch.cat([tokens.reshape(-1).to("cpu", torch.int64), named])
        self._send([Command.REFERENCE, tokens.numel()], payload)

    def send_adapter(self, slot: int, adapter: LoRARequest) -> None:
        self._send([Command.ADAPTER, slot], _encoded(adapter))

    def send_copy_block(self, src: int, dst: int) -> None:
        self._send([Command.COPY_BLOCK, src, dst], None)

    def send_copy_state(self, src: int, dst: int) -> None:
        self._send([Command.COPY_STATE, src, dst], None)

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
            tokens = fields[1]
            return Received(command, tokens=payload[:tokens].to(self.device), adapter=_decoded(payload[tokens:]))
        if command is Command.ADAPTER:
            return Received(command, adapter=_decoded(payload), slot=fields[1])
        if command in (Command.COPY_BLOCK, Command.COPY_STATE):
            return Received(command, blocks=(fields[1], fields[2]))
        if command is not Command.STEP:
            return Received(command)
        tokens, num_seqs, num_sample, want_hidden, cols, with_slots = fields[1:7]
        with_images, image_rows, width, mrope, with_states, layout, spans = fields[7:14]
        sizes = [tokens, tokens, tokens, 3 * num_seqs, num_sample, num_seqs * cols, tokens * with_slots]
        sizes += [image_rows, 3 * tokens * mrope, layout, spans]
        parts = torch.split(payload, sizes)
        ids, positions, slots = (part.to(self.device) for part in parts[:3])
        slices = parts[3].view(num_seqs, 3).tolist()
        seqs = [SeqSlice(row, count, start, index) for index, (row, count, start) in enumerate(slices)]
        if spans:  # image tokens that attend both ways: each sequence's runs
            counts, ends = parts[10][:num_seqs].tolist(), iter(parts[10][num_seqs:].tolist())
            for seq, count in zip(seqs, counts, strict=True):
                seq.spans = tuple((next(ends), next(ends)) for _ in range(count))
        tables = parts[5].view(num_seqs, cols).numpy()
        packed = PackedInputs(ids, positions, slots, seqs, tables)
        adapter_slots = parts[6].tolist() if with_slots else None
        images = None
        if with_images:
            features = None
            if image_rows:
                features = torch.empty((image_rows, width), dtype=torch.float32)
                dist.broadcast(features, 0, group=self.group)
            mrope_positions = parts[8].view(3, tokens).numpy() if mrope else None
            images = StepImages(parts[7] if image_rows else None, features, mrope_positions)
        state_layout = parts[9].tolist() if with_states else None
        return Received(
            command,
            packed,
            parts[4].tolist(),
            bool(want_hidden),
            adapter_slots=adapter_slots,
            images=images,
            state_layout=state_layout,
        )


def _image_parts(images: StepImages | None) -> list[torch.Tensor]:
    """A step's image rows and M-RoPE positions, as the payload's int64s."""
    if images is None:
        return []
    parts = [] if images.rows is None else [images.rows]
    if images.positions is not None:
        parts.append(torch.from_numpy(np.ascontiguousarray(images.positions, dtype=np.int64)).reshape(-1))
    return parts


def _encoded(adapter: LoRARequest | None) -> torch.Tensor:
    """An adapter request as int64s (its JSON's bytes, one each): what names it to every rank, which each read their
    own shard of its weights from its directory; none for ``None``."""
    if adapter is None:
        return torch.zeros(0, dtype=torch.int64)
    text = json.dumps([adapter.name, adapter.path, adapter.salt]).encode()
    return torch.tensor(list(text), dtype=torch.int64)


def _decoded(payload: torch.Tensor) -> LoRARequest | None:
    if not payload.numel():
        return None
    name, path, salt = json.loads(bytes(payload.tolist()).decode())
    return LoRARequest(name, path, int(salt))
