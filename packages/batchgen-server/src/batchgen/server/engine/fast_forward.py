"""The model's fast path, laid over its own modules: every decoder layer's forward compiled with ``torch.compile``
(regional compilation) and, on CPU, the output head's GEMM on a prepacked weight.

Each replaces a module's ``forward`` with an instance attribute, so the class's own forward is one ``pop`` away: for
an eager retry of a step, or for good once the fast path has failed where the eager one succeeds. Changing the model
in place means that engines sharing a model share its fast path.

Compiled layers: a layer's norms, projections, rotary embedding, activation and residual adds fuse into a few
kernels; the attention stays one opaque operator (``attention/__init__.py``), so what it does per step never enters
the graph. The layers share one graph (same code, the weights are inputs), so compiling costs one layer's time, and the
token count is dynamic. The model's own top (embeddings, final norm, head, logit scaling) stays eager.

The prepacked head: the head (vocabulary x hidden) is the largest GEMM of a step, run for a few sampled rows, where
oneDNN on a weight reordered once into its blocked layout beats ``linear`` on the plain one (as vLLM's CPU build does
for its linears): 25-50% faster at 4-33 rows on a 32k x 384 head, 7% more tokens per CPU-second for the whole engine
on the 35M benchmark model, same tokens (``benchmarks/RESULTS.md``). Not inside the compiled layers: inductor cannot
lower oneDNN's opaque packed tensors, and a custom operator per projection costs what it gains.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

PACKED_FOR_ROWS = 64
"""The row count oneDNN chooses the head's blocked layout for (any count runs on it)."""


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


class PrepackedLinear:
    """An ``nn.Linear``'s forward through oneDNN on a copy of its weight reordered once (the weights of a served
    model do not change). The copy is what it costs: the head's weight once more."""

    def __init__(self, linear: torch.nn.Linear, packed: torch.Tensor) -> None:
        self.bias = linear.bias
        self.packed = packed

    @classmethod
    def of(cls, module: torch.nn.Module | None) -> PrepackedLinear | None:
        """For a CPU ``nn.Linear`` whose dtype oneDNN packs on this CPU (float32 anywhere; 16-bit types where the CPU
        has the instructions); ``None`` otherwise."""
        if not isinstance(module, torch.nn.Linear) or module.weight.device.type != "cpu":
            return None
        supports: dict[torch.dtype, Callable[[], bool]] = {
            torch.float32: torch.backends.mkldnn.is_available,
            torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
            torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported,
        }
        supported = supports.get(module.weight.dtype)
        if supported is None or not supported():
            return None
        return cls(module, torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACKED_FOR_ROWS))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out


class FastForward:
    """The fast forwards of one model, in place on its modules."""

    def __init__(self, model: PreTrainedModel, attention_modules: list[torch.nn.Module]) -> None:
        self.forwards: dict[torch.nn.Module, Callable[..., Any]] = {}
        for layer in decoder_layers(model, attention_modules):
            own: Callable[..., Any] = layer.forward
            self.forwards[layer] = vars(layer).get("forward") or torch.compile(own, dynamic=True)
        head = model.get_output_embeddings()
        if head is not None:
            packed = vars(head).get("forward") or PrepackedLinear.of(head)
            if packed is not None:
                self.forwards[head] = packed
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
        self._remove()
        logger.warning("the fast forward (compiled layers, prepacked head) failed; eager from now on (%s)", reason)
