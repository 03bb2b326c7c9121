"""Paged KV cache bookkeeping: fixed-size blocks, reference counts and content-hashed prefix caching.

A full block is identified by the hash of (its parent block's hash, its token ids), so equal prefixes map to equal
hash chains. Blocks whose reference count drops to zero keep their hash and go to the back of the free list; they are
reused by a later request with the same prefix, or recycled least recently freed first.

A cache group may sit beside the blocks (``CacheGroup``, as vLLM's KV cache groups: a hybrid model's state slots,
``features/state/slots.py``) and follow them: a sequence holds its share of it while it holds blocks, a fork copies
it, and a prefix hit reaches only as far as the group can start from, which is published with the blocks it ends and
dropped when its block is recycled. The block manager knows it by this protocol alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from ..sequence import Sequence
from .block_tables import BlockTables
from .twins import Claims


class CacheGroup(Protocol):
    """A cache beside the KV blocks that follows them, per sequence."""

    @property
    def keeps_prefixes(self) -> bool:
        """A prefix hit may start from it past the blocks' first one (else no hit is ever made)."""
        ...

    def reset(self) -> None: ...

    def can_run(self, seq: Sequence) -> bool:
        """``seq`` can hold its share now (it holds it already, or some is free)."""
        ...

    def admit(self, seq: Sequence) -> None:
        """``seq`` runs: it holds its share, from where its prefix hit starts."""
        ...

    def hit(self, seq: Sequence, hashes: list[int], block_size: int) -> int:
        """How many of the cached leading blocks ``hashes`` of ``seq``'s prompt its hit may use."""
        ...

    def mark(self, seq: Sequence, boundary: int) -> None:
        """Lines waiting for ``seq``'s prompt blocks will resume at ``boundary``."""
        ...

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """``child`` continues from ``parent``'s share (``False``: none is free)."""
        ...

    def settle(self, seq: Sequence, hashes: list[int], block_size: int) -> None:
        """``seq``'s full blocks ``hashes`` are published: so is what it computed of the group with them."""
        ...

    def leave(self, seq: Sequence) -> None:
        """``seq`` stops running: its share goes back."""
        ...

    def forget(self, block_hash: int) -> None:
        """The block ``block_hash`` names was recycled: a hit can no longer start there."""
        ...


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, group: CacheGroup | None = None
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        """Free blocks, least recently freed first; a cached one leaves the hash map only when it is recycled."""
        self.group = group
        """The cache group beside the blocks, if any."""
        if group is not None:
            group.reset()
        self.tables = BlockTables()
        """The sequences' block tables as rows of one array: every change to a ``block_table`` goes through it."""
        self.claims = Claims()
        """The prompt blocks running sequences compute and have not published yet (``twin``)."""

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        if self.group is not None and not self.group.can_run(seq):
            return False
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` room for ``num_new_tokens`` more tokens (check ``can_allocate`` first)."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            self.tables.append(seq, self._take_free())
        if self.group is not None:
            if self.group.keeps_prefixes:  # the keys of what its prompt may leave to start from
                self._full_block_hashes(seq, seq.num_prompt_tokens // self.block_size)
            self.group.admit(seq)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach the cached blocks that hold a prefix of ``seq``; return how many tokens they cover.

        At least one token is always left to compute, since its logits give the next token.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        hashes = self._full_block_hashes(seq, (len(seq) - 1) // self.block_size)
        blocks: list[int] = []
        for i, block_hash in enumerate(hashes):
            block = self.hash_to_block.get(block_hash)
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            if block is None or self.block_tokens[block] != tokens:
                break
            blocks.append(block)
        if self.group is not None:
            del blocks[self.group.hit(seq, hashes[: len(blocks)], self.block_size) :]
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            self.tables.append(seq, block)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def twin(self, seq: Sequence) -> Sequence | None:
        """The running sequence computing the first block of waiting ``seq``'s prompt that is not cached (``None``:
        none): ``seq`` should wait for that block to be published rather than compute it again. With a cache group a
        hit ends where the group can start from, so that sequence is asked to leave such a point where the prefix of
        ``seq`` it computes ends (and a line finding the blocks before it published without one waits too: its hit
        will reach there)."""
        owner = self.claims.owner
        if not owner or not self.enable_prefix_caching or seq.block_table:
            return None
        if self.group is not None and not self.group.keeps_prefixes:
            return None  # a prefix is never a hit
        hashes = self._full_block_hashes(seq, (len(seq) - 1) // self.block_size)
        cached = 0
        while cached < len(hashes) and hashes[cached] in self.hash_to_block:
            cached += 1
        twin = owner.get(hashes[cached]) if cached < len(hashes) else None
        if twin is None or twin is seq:
            return None
        if self.group is not None:
            end = cached
            while end < len(hashes) and owner.get(hashes[end]) is twin:
                end += 1
            self.group.mark(twin, end * self.block_size)
        return twin

    def claim(self, seq: Sequence) -> None:
        """``seq`` is admitted: it claims the prompt blocks it is to compute (``twin``)."""
        if self.enable_prefix_caching:
            hashes = self._full_block_hashes(seq, seq.num_prompt_tokens // self.block_size)
            self.claims.claim(seq, hashes, seq.num_computed_tokens // self.block_size)

    def register_full_blocks(self, seq: Sequence, first_block: int) -> None:
        """Publish the blocks of ``seq`` from ``first_block`` on that are now full, for reuse by other requests."""
        num_full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= first_block:
            return
        hashes = self._full_block_hashes(seq, num_full)
        if self.group is not None:
            self.group.settle(seq, hashes, self.block_size)
        self.claims.settle(seq, hashes, num_full)
        for i in range(first_block, num_full):
            block = seq.block_table[i]
            if self.block_hash[block] is None:
                self.block_hash[block] = hashes[i]
                self.block_tokens[block] = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                self.hash_to_block.setdefault(hashes[i], block)

    def fork(self, parent: Sequence, child: Sequence, copy_block: Callable[[int, int], None]) -> bool:
        """Share the parent's blocks with ``child``; its last, partly filled block is copied (it will diverge).

        Returns ``False`` (sharing nothing) when no block is free for that copy.
        """
        partial = parent.num_computed_tokens % self.block_size != 0
        if (partial and not self.free) or (self.group is not None and not self.group.fork(parent, child)):
            return False
        self.tables.copy(parent, child)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        for block in child.block_table:
            self.ref_counts[block] += 1
        if partial:
            last = child.block_table[-1]
            fresh = self._take_free()
            copy_block(last, fresh)
            self.ref_counts[last] -= 1
            self.tables.replace_last(child, fresh)
        return True

    def free_seq(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):  # the tail first: prefixes stay cached longest
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        self.tables.release(seq)
        self.claims.release(seq, seq.block_hashes)
        seq.num_computed_tokens = 0
        if self.group is not None:
            self.group.leave(seq)

    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        block_hash = self.block_hash[block]
        if block_hash is not None:
            if self.hash_to_block.get(block_hash) == block:
                del self.hash_to_block[block_hash]
                if self.group is not None:
                    self.group.forget(block_hash)
            self.block_hash[block] = None
            self.block_tokens[block] = None
        self.ref_counts[block] = 1
        return block

    def _full_block_hashes(self, seq: Sequence, count: int) -> list[int]:
        """Hashes of the first ``count`` full blocks of ``seq``, computed once each and kept on the sequence."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < count:
            i = len(hashes)
            # The first block's parent is the request's salt: what else its KV depends on (0: nothing else).
            parent = hashes[-1] if hashes else seq.state.salt
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            hashes.append(hash((parent, *tokens, *seq.state.request.block_keys(i * bs, (i + 1) * bs))))
        return hashes[:count]
