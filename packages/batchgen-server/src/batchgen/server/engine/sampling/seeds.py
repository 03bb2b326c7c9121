"""The seeds of sampling: splitmix64 mixes a choice's seed with a token's position into the uniform number its draw
takes. The same hash runs in Python (``mix64``, ``uniform``: a choice's seed, the tests' reference) and on the device
for every sampled row at once (``uniforms``), bit for bit, so a draw depends on nothing else in the batch.
"""

from __future__ import annotations

import torch

_MASK64 = 2**64 - 1
_GOLDEN, _MUL1, _MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix64(*values: int) -> int:
    """splitmix64 over the values in turn: a well-spread 64-bit hash."""
    state = 0
    for value in values:
        state = (state + (value & _MASK64) + _GOLDEN) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
        z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
        state = z ^ (z >> 31)
    return state


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that depends only on ``seed`` and ``position``."""
    return (mix64(seed, position) >> 11) / 2**53


def int64_bits(value: int) -> int:
    """The int64 with the same 64 bits."""
    return value - 2**64 if value >= 2**63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 bit patterns (torch's ``>>`` is arithmetic on signed integers)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``uniform`` for every row at once: int64 tensors in (bit patterns of the 64-bit seeds), float64 out.
    Integer multiplication and addition wrap modulo 2**64 on every torch device, which is what splitmix64 needs."""
    state = torch.zeros_like(seeds)
    for value in (seeds, positions):
        z = state + value + int64_bits(_GOLDEN)
        z = (z ^ _shift_right(z, 30)) * int64_bits(_MUL1)
        z = (z ^ _shift_right(z, 27)) * int64_bits(_MUL2)
        state = z ^ _shift_right(z, 31)
    return _shift_right(state, 11).double() / 2**53
