"""A step's sequences as its state layers run them (``InputBuffers.prepare`` adds each scheduled sequence).

A mixer cannot run the packed row in one call: its convolution and scan would run across sequences, and whether it
takes its one-token path is decided per call. So every state layer runs its own forward once for all the step's
decodes (a batch of sequences continuing by one token each, the one-token path ``generate`` decodes with) and once
per other chunk (a prompt's chunk, alone: from no state where it starts the sequence, as ``generate`` prefills, else
from its slot), cut at the checkpoints the chunk writes. The Gated DeltaNet kernels (``gdn.py``) take the same
pieces in one call, as ``segments``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...ops.transfer import indices


@dataclass(frozen=True, slots=True)
class StateChunk:
    row: int
    """Its first row in the packed step."""
    num_tokens: int
    start: int
    """The position of its first token: 0 starts the sequence (no state yet)."""
    slot: int
    """The sequence's live slot."""
    checkpoints: tuple[tuple[int, int], ...]
    """(boundary, checkpoint slot): the state after the token before ``boundary`` is copied there."""

    def pieces(self) -> list[tuple[int, int, int | None]]:
        """``(first, end, checkpoint)``: the chunk's tokens ``first`` to ``end`` (offsets in it), cut at each boundary,
        each with the checkpoint slot its state is copied to (``None`` for none)."""
        pieces: list[tuple[int, int, int | None]] = []
        first = 0
        for boundary, checkpoint in self.checkpoints:
            pieces.append((first, boundary - self.start, checkpoint))
            first = boundary - self.start
        if first < self.num_tokens:
            pieces.append((first, self.num_tokens, None))
        return pieces


@dataclass(slots=True)
class StateStep:
    decode_rows: list[int] = field(default_factory=list)
    decode_slots: list[int] = field(default_factory=list)
    decode_checkpoints: list[tuple[int, int]] = field(default_factory=list)
    """(live slot, checkpoint slot): a decode that completes a checkpoint's block (a prompt's last token, say)."""
    chunks: list[StateChunk] = field(default_factory=list)
    _indices: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    _segments: torch.Tensor | None = None

    def add(self, row: int, num_tokens: int, start: int, slot: int, checkpoints: tuple[tuple[int, int], ...]) -> None:
        if num_tokens == 1 and start > 0:
            self.decode_rows.append(row)
            self.decode_slots.append(slot)
            self.decode_checkpoints += [(slot, checkpoint) for _, checkpoint in checkpoints]
        else:
            self.chunks.append(StateChunk(row, num_tokens, start, slot, checkpoints))

    def encoded(self) -> list[int]:
        """The step as int64s, for a split model's other ranks (``decoded``): decodes, their checkpoints, chunks."""
        out = [len(self.decode_rows), *self.decode_rows, *self.decode_slots, len(self.decode_checkpoints)]
        out += [value for pair in self.decode_checkpoints for value in pair]
        out.append(len(self.chunks))
        for chunk in self.chunks:
            out += [chunk.row, chunk.num_tokens, chunk.start, chunk.slot, len(chunk.checkpoints)]
            out += [value for pair in chunk.checkpoints for value in pair]
        return out

    @classmethod
    def decoded(cls, values: list[int]) -> StateStep:
        at = 0

        def take(count: int) -> list[int]:
            nonlocal at
            at += count
            return values[at - count : at]

        step = cls()
        decodes = take(1)[0]
        step.decode_rows, step.decode_slots = take(decodes), take(decodes)
        pairs = take(2 * take(1)[0])
        step.decode_checkpoints = list(zip(pairs[::2], pairs[1::2], strict=True))
        for _ in range(take(1)[0]):
            row, num_tokens, start, slot, saved = take(5)
            pairs = take(2 * saved)
            step.chunks.append(
                StateChunk(row, num_tokens, start, slot, tuple(zip(pairs[::2], pairs[1::2], strict=True)))
            )
        return step

    def index(self, values: list[int], device: torch.device) -> torch.Tensor:
        """``values`` as an index on ``device``, made once a step (every state layer reads the same ones)."""
        key = tuple(values)
        if key not in self._indices:
            self._indices[key] = indices(values, device)
        return self._indices[key]

    def segments(self) -> torch.Tensor:
        """The step as ``gdn.cpp``'s segments, int64 ``[N, 5]`` on CPU, made once a step: (first row, end row, slot,
        fresh, checkpoint slot or -1) for each decode, then each chunk's pieces in order."""
        if self._segments is None:
            saved = dict(self.decode_checkpoints)
            decodes = zip(self.decode_rows, self.decode_slots, strict=True)
            rows = [(row, row + 1, slot, 0, saved.get(slot, -1)) for row, slot in decodes]
            for chunk in self.chunks:
                for first, end, checkpoint in chunk.pieces():
                    fresh = int(chunk.start + first == 0)
                    at = chunk.row
                    rows.append((at + first, at + end, chunk.slot, fresh, -1 if checkpoint is None else checkpoint))
            self._segments = torch.tensor(rows, dtype=torch.int64).reshape(-1, 5)
        return self._segments
