"""The prompt blocks running sequences are computing and have not published yet, so that a twin waits for them.

Blocks reach the prefix cache only once computed (``BlockManager.register_full_blocks``), so lines that share a
prefix and are admitted together (n samples as separate lines, eval repeats, a burst under one system prompt) would
each compute it. Instead, a running sequence claims the hashes of the prompt blocks it is to compute, and gives each
up as its block is published (or when it stops running); the scheduler holds back a waiting line whose first block
still to compute is claimed by another (``BlockManager.twin``) and admits it once that block lands, as a prefix hit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..sequence import Sequence


class Claims:
    def __init__(self) -> None:
        self.owner: dict[int, Sequence] = {}
        """Block hash -> the running sequence computing that block (the first to claim it)."""
        self._spans: dict[Sequence, tuple[int, int]] = {}
        """A claiming sequence -> the indices of its blocks it claimed and has not published yet."""

    def claim(self, seq: Sequence, hashes: list[int], start: int) -> None:
        """``seq`` is admitted to compute its prompt blocks ``start`` to ``len(hashes)`` (``hashes``: theirs)."""
        self.release(seq, hashes)
        if start >= len(hashes):
            return
        for block_hash in hashes[start:]:
            self.owner.setdefault(block_hash, seq)
        self._spans[seq] = (start, len(hashes))

    def settle(self, seq: Sequence, hashes: list[int], num_full: int) -> None:
        """``seq``'s first ``num_full`` blocks are published: its claims on them end."""
        span = self._spans.get(seq)
        if span is None or num_full <= span[0]:
            return
        start, end = span
        self._drop(seq, hashes[start : min(num_full, end)])
        if num_full >= end:
            del self._spans[seq]
        else:
            self._spans[seq] = (num_full, end)

    def release(self, seq: Sequence, hashes: list[int]) -> None:
        """``seq`` stops running: it claims nothing."""
        span = self._spans.pop(seq, None)
        if span is not None:
            self._drop(seq, hashes[span[0] : span[1]])

    def _drop(self, seq: Sequence, hashes: list[int]) -> None:
        for block_hash in hashes:
            if self.owner.get(block_hash) is seq:
                del self.owner[block_hash]
