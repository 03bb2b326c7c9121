"""What a state layer calls on its ``cache`` argument: transformers' state API (``cache_utils.py``: ``Cache.
get_conv_state``, ``update_conv_state``, ``get_recurrent_state``, ``update_recurrent_state``, ``is_recording_past``,
and 5.25's ``get_recurrent_states_to_keep`` and ``increase_count``), over one call's states: a batch of sequences
(dimension 0) that all start fresh, or all continue.

Every recurrent mixer of transformers 5 (Gated DeltaNet, Kimi Delta Attention, Mamba 1 and 2, short convolutions)
reads and writes its state only through these methods, so the engine runs the layer's own forward over its own
slots by handing it this instead of a ``DynamicCache``. A fresh call finds no state (the layer's prefill path, as
``generate`` runs it); a continuing one finds its sequences' states, which the layer may also update in place (the
one-token paths' ``causal_conv1d_update``, ``mamba2_selective_state_update``): whatever the call leaves is read back
from here afterwards.
"""

from __future__ import annotations

from typing import Any

import torch

StateKey = tuple[int, str, int]
"""A state tensor of a layer: (``layer_idx``, ``"conv"`` or ``"recurrent"``, ``state_idx``)."""


class StateFacade:
    def __init__(self, fresh: bool) -> None:
        self.fresh = fresh
        self.current: dict[StateKey, torch.Tensor] = {}
        """The states as the call leaves them (batch first)."""

    def stored(self, key: StateKey) -> torch.Tensor | None:
        """The sequences' state ``key`` before the call (a continuing call reads it once, on first use)."""
        return None

    def kernel(self, key: StateKey, given: int | None, conv_states: torch.Tensor) -> int:
        """The columns a convolution state keeps: transformers' rule (the kernel size given, else the first input's
        length)."""
        return given or conv_states.shape[-1]

    def _state(self, key: StateKey) -> torch.Tensor | None:
        if key not in self.current and not self.fresh and (stored := self.stored(key)) is not None:
            self.current[key] = stored
        return self.current.get(key)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._state((layer_idx, "conv", state_idx))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._state((layer_idx, "recurrent", state_idx))

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``LinearAttentionLayer.update_conv_state``: the input after the columns kept (a first call left-pads it to
        the kernel), and the last ``kernel`` columns kept."""
        key = (layer_idx, "conv", state_idx)
        kernel = self.kernel(key, conv_kernel_size, conv_states)
        previous = self._state(key)
        if previous is None:
            full = torch.nn.functional.pad(conv_states, (max(0, kernel - conv_states.shape[-1]), 0))
        else:
            full = torch.cat([previous, conv_states], dim=-1)
        self.current[key] = full[..., -kernel:].clone()
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        self.current[(layer_idx, "recurrent", state_idx)] = recurrent_states
        return recurrent_states

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return not self.fresh

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        """Speculative decoding's rollback, which the engine does not use."""
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """How many states after the last tokens a multi-token call keeps for that rollback (transformers 5.25):
        none."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """A one-token call updated its convolution state in place (transformers 5.25 counts the tokens a layer has
        seen): the engine knows its sequences' positions itself."""
