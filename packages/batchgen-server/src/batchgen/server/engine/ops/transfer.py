"""Host values to the device without making the host wait."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. On CUDA the copy goes through pinned memory and does not block the host (a plain
    ``.to("cuda")`` waits for every kernel queued before it): it is ordered on the stream before every kernel that
    reads it, and the pinned block is not reused until the copy is done (PyTorch's caching host allocator)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def indices(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host integers as a ``long`` index tensor on ``device``, through ``to_device``."""
    return to_device(torch.tensor(values, dtype=torch.long), device)


class HostCopy:
    """A device tensor on its way to the host. On CUDA the copy starts now, into pinned memory, without blocking the
    host, and ``tolist`` waits for that copy alone: not for the kernels queued after it (the next step's forward,
    when steps overlap)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)  # on the stream of the tensor's device (not the current device's)
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record(torch.cuda.current_stream(tensor.device))

    def tolist(self) -> list[Any]:
        if self._event is not None:
            self._event.synchronize()
        values: list[Any] = self._host.tolist()
        return values
