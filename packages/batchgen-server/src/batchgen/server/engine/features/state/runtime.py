"""The state layers of one engine at run time: their cache, its slots, the layers' installed forwards, and what each
step hands them.

The model runner makes one at load (``States.build``) where the probe found state layers; the block manager hands
out its slots (``slots.py``) as it hands out blocks; the runner lays out each step for it (``step``), which also picks
the prefix checkpoints the step writes.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from .cache import StateCache
from .discovery import StateLayer
from .mixers import Mixers, StateRun
from .slots import StateSlots
from .step import StateStep

if TYPE_CHECKING:
    from ...attention.step import SeqSlice
    from ...scheduler_output import ScheduledSeq


class States:
    def __init__(
        self, layers: list[StateLayer], live_slots: int, checkpoint_slots: int, block_size: int, interval: int
    ) -> None:
        self.layers = layers
        self.block_size = block_size
        self.interval = interval
        """Prompts also leave a checkpoint every this many tokens (0: only at their last block boundary and at the
        prefix they are found to share with earlier prompts)."""
        self.slot_bytes = StateCache.slot_bytes(layers)
        self.cache = StateCache(layers, live_slots + checkpoint_slots)
        self.slots = StateSlots(live_slots, checkpoint_slots, self.cache.copy_slot)
        self.mixers = Mixers(layers, self.cache, None)

    @staticmethod
    def slot_bytes_of(layers: list[StateLayer]) -> int:
        return StateCache.slot_bytes(layers)

    @property
    def total_bytes(self) -> int:
        return self.cache.num_slots * self.slot_bytes

    def step(self, scheduled: Seq[ScheduledSeq], seqs: Seq[SeqSlice]) -> StateRun:
        """What the state layers run in a step of ``scheduled`` (packed as ``seqs``), taking the checkpoint slots its
        prompt chunks write (each sequence keeps them as pending until the block manager publishes them)."""
        step = StateStep()
        bs = self.block_size
        for item, piece in zip(scheduled, seqs, strict=True):
            seq = item.seq
            held = self.slots.of(seq)
            start, end = piece.start, piece.end
            checkpoints: list[tuple[int, int]] = []
            if self.slots.checkpoints and start < seq.num_prompt_tokens:
                prompt = seq.num_prompt_tokens
                # The prompt's last block boundary (what a longer prompt extending it resumes from) and the last one
                # before its end (what a repeat resumes from: a hit leaves the last token to compute); one boundary
                # unless the prompt is a whole number of blocks. And where lines waiting for its blocks resume.
                ends = (prompt // bs * bs, (prompt - 1) // bs * bs, held.reuse, *held.marks)
                for boundary in range((start // bs + 1) * bs, min(end, prompt) + 1, bs):
                    if not (boundary in ends or (self.interval and boundary % self.interval == 0)):
                        continue
                    # Keyed by the hash of the block ending there (hashed at admission: ``BlockManager.allocate``).
                    if (slot := self.slots.take(seq.block_hashes[boundary // bs - 1])) is not None:
                        checkpoints.append((boundary, slot))
                held.checkpoints += checkpoints
            step.add(piece.row, piece.num_tokens, start, held.slot, tuple(checkpoints))
        return self.mixers.bind(step)
