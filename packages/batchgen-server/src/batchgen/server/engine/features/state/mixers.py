"""The state layers driven over the state cache.

Each state layer's ``forward`` is replaced by an instance attribute (as ``fast_forward.py`` does; what was there is
one assignment away): outside a step (the probe, the self-check's reference, ``generate`` on a shared model) it is
the layer's own forward, unchanged; inside one it is the ``batchgen::state_mixer`` operator, opaque to
``torch.compile`` like the attention's, so compiled decoder layers keep it as one call. The operator runs the layer's
own forward on the step's decodes (one batched call) and on each of its chunks (``step.py``), each time with a
``SlotCache`` over the sequences' slots, and writes each call's output into the packed row. So the math is the
model's own, as ``generate`` runs it: its prefill path for a chunk that starts a sequence, its one-token path for a
decode, and for a continuing chunk its multi-token path from the sequence's state (or, where that path ignores an
initial state, its one-token path token by token: ``discovery.TOKEN_BY_TOKEN``). The exception: Gated DeltaNet
layers on CPU run ``gdn.py``'s step once on the whole row (a fast path, tested against the layer's own forward).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

from ...attention.step import PagedStep, current
from ...ops.fast_paths import FastPath
from .cache import StateCache
from .discovery import StateLayer
from .facade import StateFacade, StateKey
from .gdn import GatedDeltaNet, fast_path
from .step import StateStep


class TokenRows(Protocol):
    """What selects the per-token inputs of a call on some of the step's rows (``LoRASlots.rows``: each token's
    adapter slot)."""

    def rows(self, rows: torch.Tensor | slice) -> AbstractContextManager[None]: ...


class SlotCache(StateFacade):
    """One call's states in the state cache: read from ``slots`` where it continues its sequences, written back to
    them after the call."""

    def __init__(self, cache: StateCache, layer: StateLayer, slots: torch.Tensor, fresh: bool) -> None:
        super().__init__(fresh)
        self.cache = cache
        self.slots = slots
        self.shapes = {state.key: state for state in layer.states}

    def _shape(self, key: StateKey) -> Any:
        if key not in self.shapes:
            raise RuntimeError(f"a state layer asked for state {key}, which the probe did not see it keep")
        return self.shapes[key]

    def stored(self, key: StateKey) -> torch.Tensor:
        return self.cache.gather(self._shape(key), self.slots)

    def kernel(self, key: StateKey, given: int | None, conv_states: torch.Tensor) -> int:
        kernel: int = self._shape(key).shape[-1]
        return kernel

    def write_back(self) -> None:
        for key, value in self.current.items():
            self.cache.scatter(key, self.slots, value)


class Mixers:
    """The engine's state layers over its ``StateCache``; ``rows``: the LoRA slots, whose per-token mask each call
    cuts to its rows."""

    def __init__(self, layers: list[StateLayer], cache: StateCache, rows: TokenRows | None) -> None:
        self.layers = layers
        self.cache = cache
        self.token_rows = rows
        self.own: list[Callable[..., torch.Tensor]] = [_install(layer, index) for index, layer in enumerate(layers)]
        """Each layer's forward as it was before (its class's, or what accelerate laid over it)."""
        # The fast path needs no rows: it runs the layer's linears on the whole packed row, as the step packs it.
        found = [fast_path(layer, cache.tensors) for layer in layers]
        self.fast = [step if isinstance(step, GatedDeltaNet) else None for step in found]
        """Each layer's step over the whole packed row where it has one (``gdn.py``: Gated DeltaNet on CPU)."""
        off = "; ".join(sorted({step for step in found if isinstance(step, str)})) or None
        self.paths = [FastPath("Gated DeltaNet kernels", off)] if any(step is not None for step in found) else []
        """The fast path, where the model has layers it is written for: on, or off with why (``fast_paths.py``)."""

    def bind(self, step: StateStep) -> StateRun:
        return StateRun(self, step)

    def call(self, index: int, x: torch.Tensor, facade: SlotCache, rows: torch.Tensor | slice) -> torch.Tensor:
        """Layer ``index``'s own forward on ``x`` (the step's ``rows``), its states in ``facade``."""
        with self.token_rows.rows(rows) if self.token_rows is not None else nullcontext():
            return self.own[index](x, cache=facade)


class StateRun:
    """The state layers' part of one forward: what the operator runs, each layer once."""

    def __init__(self, mixers: Mixers, step: StateStep) -> None:
        self.mixers = mixers
        self.step = step
        self.layers_run = 0

    def encoded(self) -> list[int]:
        return self.step.encoded()

    def run(self, hidden: torch.Tensor) -> torch.Tensor:
        """The next layer on the packed row ``hidden`` ``[1, tokens, hidden]``."""
        index = self.layers_run
        mixers, step, layer = self.mixers, self.step, self.mixers.layers[index]
        cache, device = mixers.cache, hidden.device
        self.layers_run += 1
        # No plain retry on a failure: the kernels advance states in place, so a failed step is recomputed whole.
        if (fast := mixers.fast[index]) is not None:
            return fast.run(hidden, step.segments())
        out = hidden.new_empty(*hidden.shape[:-1], layer.out_features)
        if step.decode_rows:  # [decodes, 1, hidden]: the one-token path, batched
            rows, slots = step.index(step.decode_rows, device), step.index(step.decode_slots, device)
            facade = SlotCache(cache, layer, slots, fresh=False)
            out[0, rows] = mixers.call(index, hidden[0, rows].unsqueeze(1), facade, rows)[:, 0]
            facade.write_back()
            for slot, checkpoint in step.decode_checkpoints:
                cache.copy_layer(layer, slot, checkpoint)
        for chunk in step.chunks:
            live = step.index([chunk.slot], device)
            for first, end, saved in chunk.pieces():
                fresh = chunk.start + first == 0
                facade = SlotCache(cache, layer, live, fresh)
                for a, b in _calls(chunk.row + first, chunk.row + end, layer.token_by_token and not fresh):
                    out[:, a:b] = mixers.call(index, hidden[:, a:b], facade, slice(a, b))
                facade.write_back()
                if saved is not None:
                    cache.copy_layer(layer, chunk.slot, saved)
        return out


def _calls(first: int, end: int, token_by_token: bool) -> Iterator[tuple[int, int]]:
    """The rows of each call: all at once, or one at a time."""
    if not token_by_token:
        yield first, end
        return
    for row in range(first, end):
        yield row, row + 1


def _install(layer: StateLayer, index: int) -> Callable[..., torch.Tensor]:
    """Lay the step's forward over ``layer``'s module (reusing an earlier engine's, on a shared model); return the
    forward it stands in for."""
    module = layer.module
    installed = vars(module).get("forward")
    own: Callable[..., torch.Tensor] = getattr(installed, "batchgen_own", None) or module.forward
    if getattr(installed, "batchgen_layer", None) == (index, layer.out_features):
        return own
    out_features = layer.out_features
    hidden_name = next(name for name in inspect.signature(type(module).forward).parameters if name != "self")

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.compiler.is_compiling() or isinstance(current(), PagedStep):
            hidden = args[0] if args else kwargs[hidden_name]
            out: torch.Tensor = torch.ops.batchgen.state_mixer(hidden, out_features)
            return out
        return own(*args, **kwargs)

    forward.batchgen_own = own  # type: ignore[attr-defined]
    forward.batchgen_layer = (index, out_features)  # type: ignore[attr-defined]
    module.forward = forward
    return own


@torch.library.custom_op("batchgen::state_mixer", mutates_args=())
def _state_mixer(hidden: torch.Tensor, out_features: int) -> torch.Tensor:
    """The next state layer in the current step (its slots updated in place): an operator, so that a compiled decoder
    layer keeps it as one opaque call; what it does depends on the step, which is Python the compiler must not see.
    Which layer is counted at run time, as attention layers are (layers run in the order the probe found them): a
    layer index in the call would make every decoder layer a compiled graph of its own."""
    step = current()
    if not isinstance(step, PagedStep) or step.states is None:
        raise RuntimeError("a state layer runs only inside the batchgen engine's forward")
    return step.states.run(hidden)


@_state_mixer.register_fake
def _(hidden: torch.Tensor, out_features: int) -> torch.Tensor:
    return hidden.new_empty(*hidden.shape[:-1], out_features)
