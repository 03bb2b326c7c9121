"""The caches' one memory budget, split between the paged KV blocks and the state slots of a model with state
layers: the prefix checkpoints their share (``--state-checkpoint-fraction``), then one live slot per running
sequence (fewer than ``--max-num-seqs`` where a slot is dear, so that the KV blocks keep room for a full context),
then the blocks.

A model without attention layers (Mamba 2) still has blocks: they hold no bytes, but they are what the prefix cache
hashes and the checkpoints are keyed by."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import EngineConfig

MAX_BOOKKEEPING_BLOCKS = 1 << 20
"""Zero-byte blocks cost host memory alone (their lists and hash maps): at most this many."""

UNDECLARED_CONTEXT = 1 << 16
"""The context a model without attention layers gets when neither it nor ``--max-model-len`` names one (its
state does not grow with it)."""


@dataclass(frozen=True, slots=True)
class CacheSizes:
    blocks: int
    live_slots: int
    """State slots of running sequences (0 without state layers): the most sequences that run at once."""
    checkpoint_slots: int


def cache_sizes(
    budget: float | None, block_bytes: int, slot_bytes: int, config: EngineConfig, context: int | None
) -> CacheSizes:
    """The sizes in ``budget`` bytes (``None``: ``--num-kv-blocks`` names the blocks); ``block_bytes`` and
    ``slot_bytes`` are what a block and a slot cost, ``context`` the longest sequence (if the model declares one)."""
    if not slot_bytes:
        # A pipeline stage of neither attention nor state layers (an MLP's alone) leaves the size to the others.
        whole = int((budget or 0) // block_bytes) if block_bytes else MAX_BOOKKEEPING_BLOCKS
        blocks = config.num_kv_blocks or whole
        if blocks < 2:
            mib = (budget or 0) / 2**20
            raise RuntimeError(f"no memory left for the KV cache ({mib:.0f} MiB); lower the load or dtype")
        return CacheSizes(blocks, 0, 0)
    share = config.state_checkpoint_fraction if config.enable_prefix_caching else 0.0
    if not 0 <= share < 1:
        raise ValueError("--state-checkpoint-fraction must be at least 0 and below 1")
    bytes_per_token = block_bytes / config.block_size
    if budget is None:
        live = config.max_num_seqs
        blocks = config.num_kv_blocks or 0
        checkpoints = int(share * (blocks * block_bytes + live * slot_bytes) // slot_bytes)
    else:
        checkpoints = int(share * budget // slot_bytes)
        rest = budget - checkpoints * slot_bytes
        kept_for_kv = min((context or 0) * bytes_per_token, rest / 2)  # one full context, if it fits in half
        live = min(config.max_num_seqs, int((rest - kept_for_kv) // slot_bytes))
        if live < 1:
            raise RuntimeError(
                f"no memory left for one sequence's state ({slot_bytes / 2**20:.1f} MiB a sequence, "
                f"{budget / 2**20:.0f} MiB for the caches); give the cache more memory"
            )
        blocks = int((rest - live * slot_bytes) // block_bytes) if block_bytes else 0
    if not block_bytes and not blocks:
        per_sequence = -(-(context or UNDECLARED_CONTEXT) // config.block_size)
        blocks = min(live * per_sequence, MAX_BOOKKEEPING_BLOCKS)
    if blocks < 2:
        raise RuntimeError(f"no memory left for the KV cache beside {live} sequences' state; lower --max-num-seqs")
    return CacheSizes(blocks, live, checkpoints)
