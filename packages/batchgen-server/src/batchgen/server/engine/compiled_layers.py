"""Regional compilation: every decoder layer's forward compiled with ``torch.compile``, with eager as the fallback.

A layer's norms, projections, rotary embedding, activation and residual adds fuse into a few kernels; the attention
stays one opaque operator (``attention/__init__.py``), so what it does per step never enters the graph. The layers
of a model share one graph (same code, the weights are inputs), so compiling costs one layer's time, and the token
count is dynamic. The model's own top (embeddings, final norm, head, logit scaling) stays eager.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


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


class CompiledLayers:
    """Replaces each layer's ``forward`` with its compiled version (an instance attribute, so ``revert`` restores
    the class's own). Compiling changes the model in place: engines that share a model share its compiled layers."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layers = layers
        for layer in layers:
            if "forward" not in vars(layer):  # not compiled already by another engine on the same model
                compiled: Any = torch.compile(layer.forward, dynamic=True)
                layer.forward = compiled

    def revert(self, reason: str) -> None:
        for layer in self.layers:
            vars(layer).pop("forward", None)
        logger.warning("compiled decoder layers failed, running them eagerly from now on (%s)", reason)
