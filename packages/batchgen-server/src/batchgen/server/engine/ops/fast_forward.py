"""The model's fast path, laid over its own modules: every decoder layer's forward compiled with ``torch.compile``
(regional compilation) and, on CPU, the float32 linears (the layers' projections and the output head) on packed
weights.

Each replaces a module's ``forward`` with an instance attribute, so the class's own forward is one ``pop`` away: for
an eager retry of a step, or for good once the fast path has failed where the eager one succeeds. Changing the model
in place means that engines sharing a model share its fast path.

Compiled layers: a layer's norms, projections, rotary embedding, activation and residual adds fuse into a few
kernels; the attention stays one opaque operator (``attention/__init__.py``), so what it does per step never enters
the graph. The layers share one graph (same code, the weights are inputs), so compiling costs one layer's time, and the
token count is dynamic. The model's own top (embeddings, final norm, head, logit scaling) stays eager.

Packed linears (``cpu_linear.py``): a decode step's GEMMs multiply a few rows by weights that come from memory every
step; a kernel on weights packed once reads the next panel of weights while it multiplies this one, where MKL reads
then multiplies (``benchmarks/RESULTS.md``). In the compiled layers it is an opaque custom operator like the attention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PreTrainedModel

from . import cpu_linear
from .fast_paths import FastPath


def decoder_layers(model: torch.nn.Module, attention_modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The layers that hold the attention modules: for each, its nearest enclosing element of an ``nn.ModuleList``
    (``model.layers.3`` for ``model.layers.3.self_attn``); none if some attention module has no such layer."""
    modules = dict(model.named_modules())
    names = {id(module): name for name, module in modules.items()}
    layers: list[torch.nn.Module] = []
    for module in attention_modules:
        parts = names[id(module)].split(".")
        layer = next(
            (
                modules[".".join(parts[:end])]
                for end in range(len(parts), 0, -1)
                if isinstance(modules.get(".".join(parts[: end - 1])), torch.nn.ModuleList)
            ),
            None,
        )
        if layer is None:
            return []
        if not any(layer is seen for seen in layers):
            layers.append(layer)
    return layers


class FastForward:
    """The fast forwards of one model, in place on its modules: two fast paths (``fast_paths.py``), the compiled
    layers and the packed linears, switched off together (they are installed together)."""

    def __init__(
        self, model: PreTrainedModel, attention_modules: list[torch.nn.Module], on_off: Callable[[str], None]
    ) -> None:
        """``on_off`` hears that the compiled forward failed where the eager one served (after this reverted)."""
        self.forwards: dict[torch.nn.Module, Callable[..., Any]] = {}
        layers = decoder_layers(model, attention_modules)
        for layer in layers:
            own: Callable[..., Any] = layer.forward
            self.forwards[layer] = vars(layer).get("forward") or torch.compile(own, dynamic=True)
        head = model.get_output_embeddings()
        packed, refused = 0, "no float32 CPU linear"
        for linear in [*(module for layer in layers for module in layer.modules()), head]:
            if forward := cpu_linear.forward_of(linear):
                self.forwards[linear] = forward
                packed += 1
            elif isinstance(linear, torch.nn.Linear):
                refused = cpu_linear.refusal(linear) or "the native kernel is unavailable"
        self.paths = [
            FastPath("compiled layers", None if layers else "no decoder layers found", on_off=on_off),
            FastPath("packed linears", None if packed else refused),
        ]
        self._install()

    def _install(self) -> None:
        for module, forward in self.forwards.items():
            module.forward = forward

    def _remove(self) -> None:
        for module in self.forwards:
            vars(module).pop("forward", None)

    @contextmanager
    def off(self) -> Iterator[None]:
        """The model's own forwards for the duration (an eager retry)."""
        self._remove()
        try:
            yield
        finally:
            self._install()

    def revert(self, reason: str) -> None:
        """For good: the model's own forwards from now on (the packed linears with them); the model runner calls it
        when the compiled forward failed."""
        self._remove()
        for module in self.forwards:
            cpu_linear.unpack(module)
        self.paths[1].switch_off(reason)
