"""Which modules keep state across a sequence's tokens (recurrent mixers, short convolutions), and the shapes of what
they keep: found at load by a probe forward in which each candidate module is handed a recording cache.

A candidate is a module whose forward takes ``cache``, that neither is nor holds an attention layer (those the
attention probe found run with no cache, as in a step) and that holds no other candidate: the mixer, not its decoder
layer. The probe forward hands each a ``RecordingCache``, which records every state a candidate keeps against it. A
model that keeps state any other way is still caught by the self-check.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch

from ...attention.layer import IRRELEVANT
from .facade import StateFacade, StateKey

TOKEN_BY_TOKEN = {
    "JambaMambaMixer": "its selective scan takes no initial state",
    "MambaMixer": "its selective scan takes no initial state",
    "FalconMambaMixer": "its selective scan takes no initial state",
}
"""Mixers whose multi-token path restarts from a zero state (``mamba_selective_scan``): a chunk that continues a
sequence runs one token at a time through their one-token path instead, which takes the state."""


class StateRefused(Exception):
    """A state layer does something the engine cannot drive (the message says what)."""


@dataclass(frozen=True, slots=True)
class StateShape:
    """One state tensor a layer keeps per sequence."""

    key: StateKey
    shape: tuple[int, ...]
    """Per sequence (the layer's tensors have the batch first); a convolution state's last dimension is its kernel."""
    dtype: torch.dtype
    device: torch.device

    def bytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize


@dataclass(eq=False)
class StateLayer:
    module: torch.nn.Module
    states: list[StateShape] = field(default_factory=list)
    out_features: int = 0
    """The last dimension of what its forward returns."""

    @property
    def token_by_token(self) -> bool:
        """Whether a chunk continuing a sequence runs one token at a time (``TOKEN_BY_TOKEN``)."""
        return type(self.module).__name__ in TOKEN_BY_TOKEN


@cache
def _takes_cache(forward: Callable[..., Any]) -> bool:
    return "cache" in inspect.signature(forward).parameters


class RecordingCache(StateFacade):
    """The probe's cache: one sequence from position 0, every state recorded against the running candidate."""

    def __init__(self) -> None:
        super().__init__(fresh=True)
        self.running: list[StateLayer] = []
        """The candidates whose forward is running, innermost last (one, unless a candidate runs another's code)."""
        self.order: list[StateLayer] = []
        """The state layers in the order they first kept state: the order a step runs them in."""

    def kernel(self, key: StateKey, given: int | None, conv_states: torch.Tensor) -> int:
        kernel = super().kernel(key, given, conv_states)
        self._record(key, (*conv_states.shape[1:-1], kernel), conv_states)
        return kernel

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        self._record((layer_idx, "recurrent", state_idx), tuple(recurrent_states.shape[1:]), recurrent_states)
        return super().update_recurrent_state(recurrent_states, layer_idx, state_idx)

    def _record(self, key: StateKey, shape: tuple[int, ...], like: torch.Tensor) -> None:
        if not self.running:
            raise StateRefused(f"its state for layer {key[0]} is kept outside the layers that take a cache")
        layer = self.running[-1]
        if not layer.states:
            self.order.append(layer)
        if any(state.key == key for state in layer.states):
            raise StateRefused(f"{type(layer.module).__name__} updates its {key[1]} state twice in one forward")
        layer.states.append(StateShape(key, shape, like.dtype, like.device))


def state_candidates(model: torch.nn.Module, attention_modules: list[torch.nn.Module]) -> list[StateLayer]:
    """The outermost modules outside attention whose forward takes a cache: what may be a state layer."""
    names = {id(module): name for name, module in model.named_modules()}
    attention = [names[id(module)] for module in attention_modules]
    outside = {
        name: module
        for name, module in model.named_modules()
        if _takes_cache(type(module).forward) and not any(_within(other, name) for other in attention)
    }
    return [
        StateLayer(module)
        for name, module in outside.items()
        if not any(_within(other, name) for other in outside if other != name)
    ]


def discover(candidates: list[StateLayer], forward: Callable[[], None]) -> list[StateLayer]:
    """The state layers among ``candidates`` (``state_candidates``), in the order they run, found by ``forward()``
    (a probe forward of one short sequence); raises ``StateRefused`` for one the engine cannot drive."""
    if not candidates:  # an attention-only model: no second forward
        return []
    recording = RecordingCache()
    previous = {layer: vars(layer.module).get("forward") for layer in candidates}
    for layer in candidates:
        layer.module.forward = _recording_forward(layer, recording)
    try:
        forward()
    finally:
        for layer, own in previous.items():
            if own is None:
                vars(layer.module).pop("forward", None)
            else:
                layer.module.forward = own
    return recording.order


def _within(name: str, parent: str) -> bool:
    """Whether module ``name`` is ``parent`` or inside it (``""`` is the model)."""
    return not parent or name == parent or name.startswith(parent + ".")


def _recording_forward(layer: StateLayer, recording: RecordingCache) -> Callable[..., Any]:
    """``layer``'s forward (whatever it is now: its class's, or what an earlier engine or accelerate laid over it)
    with the recording cache where it is given none."""
    module = layer.module
    own = module.forward
    signature = inspect.signature(type(module).forward)
    var_keyword = next((name for name, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), "")

    def forward(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(module, *args, **kwargs).arguments
        del arguments[next(iter(signature.parameters))]  # self
        if arguments.get("cache") is None:
            arguments["cache"] = recording
        extra = arguments.pop(var_keyword, {})
        recorded = len(layer.states)
        recording.running.append(layer)
        try:
            out = own(**arguments, **extra)
        finally:
            recording.running.pop()
        if len(layer.states) > recorded:
            _check_call(layer, {**arguments, **extra}, out)
        return out

    return forward


def _check_call(layer: StateLayer, arguments: dict[str, Any], out: Any) -> None:
    """What a step hands the layer is its hidden states alone (no mask, no other keyword): refuse a layer that asks
    for more, or returns something else than hidden states."""
    name = type(layer.module).__name__
    hidden = arguments.pop(next(iter(arguments)))
    for key, value in arguments.items():
        if key not in IRRELEVANT | {"cache", "attention_mask"} and value is not None and value is not False:
            raise StateRefused(f"its state layer {name} is called with `{key}`, which the engine does not pass")
    if not isinstance(out, torch.Tensor) or out.shape[:-1] != hidden.shape[:-1] or out.dtype != hidden.dtype:
        raise StateRefused(f"its state layer {name} returns something else than one tensor of hidden states")
    layer.out_features = out.shape[-1]
