"""The state cache beside the paged KV cache: every state tensor of every state layer, one row per slot.

A slot holds one sequence's state after some token: a running sequence's live slot, which its steps read and write
in place, or a prefix checkpoint, a copy of every layer's state at a block boundary (``slots.py`` hands them out).
Per tensor ``[slots, *shape]``, in the dtype the layer produced in the probe (a recurrent state in float32 where the
model computes it so) and on its layer's device.
"""

from __future__ import annotations

import torch

from .discovery import StateLayer, StateShape
from .facade import StateKey


class StateCache:
    def __init__(self, layers: list[StateLayer], num_slots: int) -> None:
        self.layers = layers
        self.num_slots = num_slots
        # Zeroed: no slot ever holds a NaN a masked-out or padding row could carry.
        self.tensors: dict[StateKey, torch.Tensor] = {
            state.key: torch.zeros((num_slots, *state.shape), dtype=state.dtype, device=state.device)
            for layer in layers
            for state in layer.states
        }

    @staticmethod
    def slot_bytes(layers: list[StateLayer]) -> int:
        """What one slot costs: every state tensor of every layer."""
        return sum(state.bytes() for layer in layers for state in layer.states)

    def gather(self, state: StateShape, slots: torch.Tensor) -> torch.Tensor:
        """The states of ``slots``, batch first (a copy: the layer may update it in place)."""
        tensor = self.tensors[state.key]
        return tensor.index_select(0, slots.to(tensor.device))

    def scatter(self, key: StateKey, slots: torch.Tensor, value: torch.Tensor) -> None:
        tensor = self.tensors[key]
        tensor.index_copy_(0, slots.to(tensor.device), value.to(tensor.dtype))

    @torch.no_grad()
    def copy_slot(self, src: int, dst: int) -> None:
        """Every layer's state (a fork's, a checkpoint's restored into a live slot)."""
        for tensor in self.tensors.values():
            tensor[dst] = tensor[src]

    @torch.no_grad()
    def copy_layer(self, layer: StateLayer, src: int, dst: int) -> None:
        """One layer's states (a checkpoint taken inside a prefill chunk, layer by layer as the forward goes)."""
        for state in layer.states:
            tensor = self.tensors[state.key]
            tensor[dst] = tensor[src]
