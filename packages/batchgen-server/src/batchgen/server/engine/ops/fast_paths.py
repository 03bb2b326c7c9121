"""The engine's fast paths (compiled layers, packed linears, the native decode kernel, one varlen call for a step's
prefill chunks, CUDA graphs), each with the plain path it stands in for, under one rule:

- a fast path checks what it is handed before it runs, and steps aside for anything it was not written for (a
  tensor subclass such as a quantized weight, another dtype or layout): no native kernel ever reads memory it does
  not understand;
- if it fails where the plain path succeeds on the same inputs, it is switched off for good with the reason, logged
  once; if the plain path fails too, the fault is the inputs', and it raises as it would have anyway;
- where the step cannot simply be run again (a hybrid model's state layers advance their states in place as the
  forward goes), a failure raises ``FastPathOff``: the engine computes the step again from its sequences' first
  tokens (``engine.py``'s ``rewound``) with the fast path ``bypassed``, and switches it off if that succeeds.

Which are on, and why one is off, is in ``EngineStats.fast_paths`` (``/metrics``) and the engine's start-up log.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")


class FastPathOff(RuntimeError):
    """A fast path failed where the step could not be run again as it was: the step is to be computed again from
    scratch on the plain path (``path.bypassed()``), and the fast path switched off if the plain one serves."""

    def __init__(self, path: FastPath, reason: str) -> None:
        super().__init__(reason)
        self.path = path
        self.reason = reason


class FastPath:
    """One fast path's state: on, or off with the reason."""

    def __init__(self, name: str, off: str | None = None, on_off: Callable[[str], None] | None = None) -> None:
        self.name = name
        self.off: str | None = off
        """Why the plain path serves instead (``None`` while the fast one does); given at the start when the fast
        path steps aside for what it is handed (said in the start-up log, not as a warning)."""
        self._on_off = on_off
        """What switching it off undoes (the compiled forwards installed on the model...), told the reason."""
        self._bypassed = False

    @property
    def on(self) -> bool:
        return self.off is None

    def run(self, fast: Callable[[], T], plain: Callable[[], T], *, retry: bool = True) -> T:
        """``fast()``; should it raise, ``plain()`` (whose own failure is the inputs' and raises), and the fast
        path is off from then on. Without ``retry`` (the fast path changed state the plain one would start from),
        ``FastPathOff`` is raised instead of running ``plain()``."""
        if self.off is not None or self._bypassed:
            return plain()
        try:
            return fast()
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if not retry:
                raise FastPathOff(self, reason) from exc
            result = plain()
            self.switch_off(reason)
            return result

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """The plain path serves while the block runs (a step computed again after ``FastPathOff``)."""
        self._bypassed = True
        try:
            yield
        finally:
            self._bypassed = False

    def switch_off(self, reason: str) -> None:
        if self.off is None:
            self.off = reason
            logger.warning("%s: off from now on, the plain path serves (%s)", self.name, reason)
            if self._on_off is not None:
                self._on_off(reason)

    def state(self) -> tuple[str, str | None]:
        return self.name, self.off


def plain_tensor(tensor: object, dtype: torch.dtype | None = None, device: str | None = None) -> bool:
    """Whether ``tensor`` is an ordinary strided torch tensor (a ``Parameter`` of one included), of ``dtype`` and on
    a ``device`` of that type where given: what a native kernel may read by its data pointer. A tensor subclass (a
    quantized weight: torchao's, bitsandbytes') reports a float dtype over memory laid out otherwise."""
    if not isinstance(tensor, torch.Tensor):
        return False
    data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
    return (
        type(data) is torch.Tensor
        and data.layout == torch.strided
        and (dtype is None or data.dtype == dtype)
        and (device is None or data.device.type == device)
    )


def describe(paths: list[FastPath]) -> str:
    """``"decode kernel on, packed linears off (why)"`` for the start-up log."""
    if not paths:
        return "none (the model runs eagerly)"
    return ", ".join(f"{p.name} on" if p.on else f"{p.name} off ({p.off})" for p in paths)
