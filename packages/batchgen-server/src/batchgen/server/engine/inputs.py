"""A scheduled step as the model's inputs: one packed row of token ids, positions and cache slots.

They are written into one host array allocated once (numpy views, no Python lists of every token), and reach the
device in one transfer, which does not block the host on CUDA (``to_device``). An input token the previous step
sampled and the host has not read yet (``PENDING``) is taken from that step's output where it is, on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .attention import SeqSlice
from .scheduler import ScheduledSeq
from .transfer import indices, to_device


@dataclass(frozen=True, slots=True)
class DeviceTokens:
    """Input tokens still on the device: packed row ``rows[i]`` takes ``tokens[sources[i]]``."""

    rows: list[int]
    sources: list[int]
    tokens: torch.Tensor


@dataclass(frozen=True, slots=True)
class PackedInputs:
    input_ids: torch.Tensor
    """``[tokens]`` on the device, as are the two below."""
    positions: torch.Tensor
    slots: torch.Tensor
    """Cache slot of each token: ``block * block_size + offset``."""
    seqs: list[SeqSlice]
    block_tables: np.ndarray
    """The rows the ``seqs`` name (``block_tables.py``)."""

    @property
    def all_decodes(self) -> bool:
        return all(seq.num_tokens == 1 for seq in self.seqs)


class InputBuffers:
    def __init__(self, capacity: int, block_size: int, device: torch.device) -> None:
        self._host = np.zeros((3, capacity), dtype=np.int64)
        self.block_size = block_size
        self.device = device

    def pack(
        self, scheduled: list[ScheduledSeq], block_tables: np.ndarray, device_tokens: DeviceTokens | None = None
    ) -> PackedInputs:
        """The step's inputs; its sequences' blocks are rows of ``block_tables`` (``block_tables.py``)."""
        total = sum(item.num_tokens for item in scheduled)
        if total > self._host.shape[1]:
            self._host = np.zeros((3, total), dtype=np.int64)
        ids, positions, slots = self._host
        bs = self.block_size
        seqs: list[SeqSlice] = []
        row = 0
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            seqs.append(SeqSlice(row, n, start, seq.table_row))
            if n == 1:  # a decode: scalars are cheaper than numpy calls (and the list than the array)
                slot = seq.block_table[start // bs] * bs + start % bs
                ids[row], positions[row], slots[row] = seq.token_ids[start], start, slot
            else:
                span = np.arange(start, start + n)
                ids[row : row + n] = seq.token_ids[start : start + n]
                positions[row : row + n] = span
                slots[row : row + n] = block_tables[seq.table_row, span // bs] * bs + span % bs
            row += n
        # Contiguous, so that pinning and a non-blocking copy need no pageable staging copy first.
        packed = to_device(torch.from_numpy(np.ascontiguousarray(self._host[:, :row])), self.device)
        if device_tokens is not None:
            chosen = device_tokens.tokens[indices(device_tokens.sources, self.device)]
            packed[0].index_copy_(0, indices(device_tokens.rows, self.device), chosen)
        return PackedInputs(packed[0], packed[1], packed[2], seqs, block_tables)
