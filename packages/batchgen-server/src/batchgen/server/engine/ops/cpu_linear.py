"""A float32 ``nn.Linear`` on CPU through ``cpu_linear.cpp`` for the few rows of a decode step, MKL for the rest.

A decode step multiplies one row per sequence by every weight matrix, so its GEMMs read far more weight than they
compute with; the kernel multiplies a copy of the weight packed once into panels and reads the next panel while it
multiplies this one. For more rows (prefill chunks, large batches) MKL is as fast or faster, so ``linear`` keeps the
layer's own weight and calls MKL there: the cost is that copy, the linears' weights once more in memory
(``benchmarks/RESULTS.md``).

``batchgen::panel_linear`` is a torch operator written in C++ (schema, checks, MKL's fallback and the kernel), so a
compiled layer calls it as one opaque node, with the panels as an input like the weight (the layers still share one
compiled graph), and an eager call is one dispatch into C++, with no Python on the way (seven calls a layer a decode
step).
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from pathlib import Path

import torch

from . import native
from .fast_paths import plain_tensor

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
ROWS = range(2, 65)
"""The row counts the kernel takes (``cpu_linear.cpp``'s ``MIN_ROWS`` to ``MAX_ROWS``); others run ``F.linear``."""


def refusal(module: torch.nn.Module | None) -> str | None:
    """Why the kernel cannot take ``module``'s place (``None`` if it can): it reads a plain float32 CPU weight by its
    data pointer, so a quantized weight (a tensor subclass) or another dtype steps aside to the module's own forward."""
    if not isinstance(module, torch.nn.Linear) or module.in_features == 0:
        return "not a linear layer"
    if not plain_tensor(module.weight, torch.float32, "cpu"):
        weight = module.weight
        kind = type(weight.data if isinstance(weight, torch.nn.Parameter) else weight).__name__
        return f"its weight is a {kind} of {weight.dtype} on {weight.device.type}, not a plain float32 CPU tensor"
    if module.bias is not None and not plain_tensor(module.bias, torch.float32, "cpu"):
        return "its bias is not a plain float32 CPU tensor"
    installed = vars(module).get("forward")
    if installed is not None and getattr(installed, "__func__", None) is not _forward:
        return "its forward is another's (a quantizer's, a hook's)"  # compressed-tensors' decompressing forward
    return None


def supports(module: torch.nn.Module | None) -> bool:
    return refusal(module) is None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out x in) in the kernel's panels; raises ``native.Unavailable``."""
    native.load(SOURCE)
    panels: torch.Tensor = torch.ops.batchgen.pack_panels(weight.detach())
    return panels


def linear(x: torch.Tensor, weight: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the panels (``pack(weight)``) for the row counts in ``ROWS``."""
    out: torch.Tensor = torch.ops.batchgen.panel_linear(x, weight, panels, bias)
    return out


def forward_of(module: torch.nn.Module | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A forward for ``module`` through the kernel, where ``supports`` holds and the kernel builds (else ``None``): the
    one already installed if another engine on this model packed it; none over anyone else's forward (a hook's). The
    panels become a buffer of the module, so a compiled layer takes them as an input, as it takes the weight, and the
    layers keep sharing one graph."""
    if not supports(module):
        return None
    assert isinstance(module, torch.nn.Linear)
    installed = vars(module).get("forward")
    if installed is not None:
        return installed if getattr(installed, "__func__", None) is _forward else None
    try:
        panels = pack(module.weight)
    except native.Unavailable as exc:
        _warn_once(str(exc))
        return None
    module.register_buffer("panels", panels, persistent=False)
    return types.MethodType(_forward, module)


def unpack(module: torch.nn.Module) -> None:
    """Free the panels of a module ``forward_of`` packed (its forward no longer uses them)."""
    module._buffers.pop("panels", None)


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    panels = self.panels
    assert isinstance(panels, torch.Tensor)
    return linear(x, self.weight, panels, self.bias)


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning("the linears run on MKL alone: %s", reason)
