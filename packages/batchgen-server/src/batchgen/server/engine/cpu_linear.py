"""A float32 ``nn.Linear`` on CPU through ``cpu_linear.cpp`` for the few rows of a decode step, MKL for the rest.

A decode step multiplies one row per sequence by every weight matrix, so its GEMMs read far more weight than they
compute with; the kernel multiplies a copy of the weight packed once into panels and reads the next panel while it
multiplies this one. For more rows (prefill chunks, large batches) MKL is as fast or faster, so ``linear`` keeps the
layer's own weight and calls MKL there: the cost is that copy, the linears' weights once more in memory
(``benchmarks/RESULTS.md``).

``batchgen::panel_linear`` is a custom operator, so a compiled layer calls it as one opaque node (inductor cannot lower
a ``ctypes`` call), with the panels as an input like the weight: the layers still share one compiled graph.
"""

from __future__ import annotations

import ctypes
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
"""The row counts the kernel takes (``benchmarks/cpu_linear.py``: at one row MKL's path for a vector is as fast, from
64 to 128 rows the two are level, and from there MKL is ahead)."""


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
    out_features, in_features = weight.shape
    plain = weight.detach().contiguous()  # held: the C++ reads it
    panels = torch.empty(_panels_size(out_features, in_features), dtype=torch.float32)
    library().batchgen_pack_panels(out_features, in_features, plain.data_ptr(), panels.data_ptr())
    return panels


def _panels_size(out_features: int, in_features: int) -> int:
    return -(-out_features // _panel_width()) * _panel_width() * in_features


@functools.cache
def _panel_width() -> int:
    """Columns a panel: the build's vector width decides it (asked once: it is checked on every call)."""
    return int(library().batchgen_panel_width())


# Registered with ``torch.library.Library`` rather than ``custom_op``: its wrapper costs 20 us a call, where a decode
# step makes seven calls a layer.
_LIBRARY = torch.library.Library("batchgen", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIBRARY.define("panel_linear(Tensor x, Tensor weight, Tensor panels, Tensor? bias) -> Tensor")  # type: ignore[no-untyped-call]


def linear(x: torch.Tensor, weight: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the panels (``pack(weight)``) for the row counts in ``ROWS``."""
    out: torch.Tensor = torch.ops.batchgen.panel_linear(x, weight, panels, bias)
    return out


def _cpu_implementation(
    x: torch.Tensor, weight: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    # The panels are a copy: a served model's weights do not change; one converted or reshaped since takes torch's.
    if (
        rows not in ROWS
        or not plain_tensor(x, torch.float32)
        or not plain_tensor(weight, torch.float32)
        or panels.numel() != _panels_size(out_features, in_features)
    ):
        return torch.nn.functional.linear(x, weight, bias)
    flat = x.reshape(rows, in_features)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    out = torch.empty(rows, out_features, dtype=torch.float32)
    library().batchgen_panel_linear(
        rows, out_features, in_features, flat.data_ptr(), flat.stride(0), panels.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], out_features)


def _shape(x: torch.Tensor, weight: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_LIBRARY.impl("panel_linear", _cpu_implementation, "CPU")  # type: ignore[no-untyped-call]
torch.library.register_fake("batchgen::panel_linear", _shape, lib=_LIBRARY)


@functools.cache
def library() -> ctypes.CDLL:
    """The built kernel; raises ``native.Unavailable``."""
    lib = native.load(SOURCE)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.batchgen_panel_width.restype = ctypes.c_int
    lib.batchgen_pack_panels.argtypes = [i64, i64, ptr, ptr]
    lib.batchgen_pack_panels.restype = None
    lib.batchgen_panel_linear.argtypes = [i64, i64, i64, ptr, i64, ptr, ptr, ptr, ctypes.c_int]
    lib.batchgen_panel_linear.restype = None
    return lib


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
