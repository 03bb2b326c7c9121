"""The state cache's slots as the scheduler hands them out (no torch here: copies go through a callback).

- **Live slots**: each running sequence holds one, its state after its computed tokens, read and written in place
  by its steps. Taken on admission (or fork) and given back on finish, abort or preemption, like a LoRA adapter's
  slot: a sequence that finds none free waits.
- **Checkpoints**: a slot holding every state layer's state at a block boundary, keyed by the hash of the KV block
  that ends there (so by the whole prefix, LoRA salt included, as blocks are). Taken for a step that crosses the
  boundary (unless that key is already kept or being written: repeats of a prompt evict nothing), published once
  that step is settled, found by later admissions (restored into their live slot: a prefix hit); kept least
  recently used first within their budget, and dropped with their block when the block manager recycles it.

Slot numbers: live slots first, then the checkpoints, all rows of one ``StateCache``.

The block manager drives them as the cache group beside its KV blocks (``core/block_manager.py``'s ``CacheGroup``);
what each sequence holds of them is kept here (``SeqState``), not on the sequence.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...sequence import Sequence


@dataclass(slots=True)
class SeqState:
    """What one sequence holds of the state cache."""

    slot: int = -1
    """Its live slot while it runs."""
    source: int | None = None
    """The checkpoint its prefix hit starts from, copied into its live slot when it is admitted."""
    checkpoints: list[tuple[int, int]] = field(default_factory=list)
    """(boundary, checkpoint slot): checkpoints its steps write, published once settled."""
    reuse: int = 0
    """A boundary its prompt shares with an earlier one that has no checkpoint: it leaves one there."""
    marks: set[int] = field(default_factory=set)
    """Boundaries where lines waiting for its prompt's blocks resume (``BlockManager.twin``): it leaves a checkpoint
    at each."""


class StateSlots:
    def __init__(self, live: int, checkpoints: int, copy: Callable[[int, int], None]) -> None:
        self.live = live
        self.checkpoints = checkpoints
        self.copy = copy
        """Copies one slot's states into another (``StateCache.copy_slot``), in the device's order of work."""
        self._free_live: list[int] = []
        self._free_checkpoints: list[int] = []
        self._published: OrderedDict[int, int] = OrderedDict()
        """Block hash -> checkpoint slot, least recently used first."""
        self._writing: dict[int, int] = {}
        """Checkpoint slot -> block hash, taken by a step and not yet published or discarded."""
        self._last_prompt: list[int] = []
        """The prompt of the sequence admitted last: what the next one is compared with (``hit``)."""
        self._held: dict[Sequence, SeqState] = {}
        self.reset()

    def reset(self) -> None:
        """No sequence holds a slot, and no checkpoint is kept (the engine reset: the prefix cache is empty)."""
        self._free_live = list(range(self.live - 1, -1, -1))
        self._free_checkpoints = list(range(self.live + self.checkpoints - 1, self.live - 1, -1))
        self._published.clear()
        self._writing.clear()
        self._last_prompt = []
        self._held.clear()

    @property
    def keeps_prefixes(self) -> bool:
        """A prefix hit may reach past the live state (there are checkpoints to start from)."""
        return bool(self.checkpoints)

    def of(self, seq: Sequence) -> SeqState:
        """What ``seq`` holds (nothing yet: a fresh record, kept until it leaves)."""
        held = self._held.get(seq)
        if held is None:
            held = self._held[seq] = SeqState()
        return held

    # ---- live slots ----------------------------------------------------------------------------------------------

    def can_take(self) -> bool:
        return bool(self._free_live)

    def acquire(self) -> int:
        """A live slot (check ``can_take``)."""
        return self._free_live.pop()

    def release(self, slot: int) -> None:
        self._free_live.append(slot)

    # ---- checkpoints ---------------------------------------------------------------------------------------------

    @property
    def published(self) -> int:
        return len(self._published)

    def longest(self, hashes: list[int]) -> tuple[int, int | None]:
        """The most leading blocks of ``hashes`` that end at a checkpoint, and its slot (``(0, None)``: none)."""
        for blocks in range(len(hashes), 0, -1):
            slot = self._published.get(hashes[blocks - 1])
            if slot is not None:
                self._published.move_to_end(hashes[blocks - 1])
                return blocks, slot
        return 0, None

    def take(self, block_hash: int) -> int | None:
        """A checkpoint slot for a step to write the state after the block ``block_hash`` into (the least recently
        used checkpoint evicted for it where none is free); ``None`` when that block's checkpoint is already kept
        (which counts as a use) or being written (one copy is enough: a repeated prompt must not evict others), or
        when every slot is being written."""
        if block_hash in self._published:
            self._published.move_to_end(block_hash)
            return None
        if block_hash in self._writing.values():
            return None
        if not self._free_checkpoints and self._published:
            _, slot = self._published.popitem(last=False)
            self._free_checkpoints.append(slot)
        if not self._free_checkpoints:
            return None
        slot = self._free_checkpoints.pop()
        self._writing[slot] = block_hash
        return slot

    def publish(self, block_hash: int, slot: int) -> None:
        """The step that wrote ``slot`` is settled: it holds the state after the block ``block_hash``."""
        self._writing.pop(slot, None)
        if block_hash in self._published:  # kept meanwhile (a block recycled and computed again): one is enough
            self._published.move_to_end(block_hash)
            self._free_checkpoints.append(slot)
        else:
            self._published[block_hash] = slot

    def discard(self, slot: int) -> None:
        """A checkpoint slot taken and never published (its sequence stopped, or its step failed)."""
        self._writing.pop(slot, None)
        self._free_checkpoints.append(slot)

    def forget(self, block_hash: int) -> None:
        """The block ``block_hash`` names was recycled: its checkpoint cannot be a hit any more."""
        slot = self._published.pop(block_hash, None)
        if slot is not None:
            self._free_checkpoints.append(slot)

    # ---- a sequence's slots, as the block manager moves it ---------------------------------------------------------

    def hit(self, seq: Sequence, hashes: list[int], block_size: int) -> int:
        """Of the leading cached blocks ``hashes`` of ``seq``'s prompt, how many its prefix hit may use: those up to
        the longest that ends at a checkpoint (the recurrent layers need the state there), which its live slot starts
        from. Where the KV blocks reach further, that boundary is a prefix shared with an earlier prompt: the
        sequence leaves a checkpoint there as it computes it (a reuse point). So does the prefix it shares with the
        prompt admitted just before it (a batch's lines under one system prompt, before any of them is cached), up
        to where a repeat of it resumes (the same prompt again: its last token is always computed)."""
        held = self.of(seq)
        blocks, held.source = self.longest(hashes)
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        # Where a line repeating this prompt can resume: a hit leaves its last token to compute.
        shared = min(_common_prefix(prompt, self._last_prompt), len(prompt) - 1) // block_size * block_size
        self._last_prompt = prompt
        reuse = max(len(hashes) * block_size, shared)
        held.reuse = reuse if reuse > blocks * block_size else 0
        return blocks

    def mark(self, seq: Sequence, boundary: int) -> None:
        """Lines waiting for ``seq``'s prompt blocks resume at ``boundary``: it leaves a checkpoint there."""
        self.of(seq).marks.add(boundary)

    def can_run(self, seq: Sequence) -> bool:
        held = self._held.get(seq)
        return (held is not None and held.slot >= 0) or self.can_take()

    def admit(self, seq: Sequence) -> None:
        """``seq`` runs: it holds a live slot, holding its prefix hit's checkpoint where it has one."""
        held = self.of(seq)
        if held.slot < 0:
            held.slot = self.acquire()
        if held.source is not None:
            self.copy(held.source, held.slot)
            held.source = None

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """``child`` continues from ``parent``'s state (``False``: no live slot free)."""
        if not self.can_take():
            return False
        slot = self.of(child).slot = self.acquire()
        self.copy(self.of(parent).slot, slot)
        return True

    def settle(self, seq: Sequence, hashes: list[int], block_size: int) -> None:
        """Publish ``seq``'s checkpoints whose boundaries its settled steps have computed (``hashes``: its full
        blocks')."""
        held = self._held.get(seq)
        if held is None:
            return
        pending = []
        for boundary, slot in held.checkpoints:
            if boundary // block_size <= len(hashes):
                self.publish(hashes[boundary // block_size - 1], slot)
            else:
                pending.append((boundary, slot))
        held.checkpoints = pending

    def leave(self, seq: Sequence) -> None:
        """``seq`` stops running (finished, aborted, preempted): its live slot goes back, with the checkpoints it did
        not get to publish."""
        held = self._held.pop(seq, None)
        if held is None:
            return
        if held.slot >= 0:
            self.release(held.slot)
        for _, slot in held.checkpoints:
            self.discard(slot)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
