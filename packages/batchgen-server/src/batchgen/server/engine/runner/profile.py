"""Memory from a profiled step (vLLM's ``profile_run``): the largest step the scheduler may send is run once before
the cache exists, its peak measured, and the caches get what is left.

On CUDA the peak is the caching allocator's (what torch allocates: a communication library's own buffers aside); on
CPU it is the process's peak resident set, reset through ``/proc/self/clear_refs`` before the step (Linux; elsewhere
nothing is measured and ``--cpu-kv-cache-gib`` stands). On CPU the flag names the cache's size; it is cut to what the
machine has left beside the step (a share of it for each rank of a group started here), with a warning, rather than
let the kernel's OOM killer take the server when the cache's pages fill hours into a job."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import EngineConfig

logger = logging.getLogger(__name__)

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
MEMINFO = Path("/proc/meminfo")


def peak_bytes(run: Callable[[], None], device: torch.device) -> int:
    """The bytes ``run`` holds at its peak beyond what was held before it (0 where this cannot be measured)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        torch.cuda.empty_cache()  # what the step freed goes back to the device, where mem_get_info sees it
        return peak
    try:
        before = _status_kib("VmRSS")
        CLEAR_REFS.write_text("5")  # the peak resident set (VmHWM) starts again from the current one
    except OSError:
        run()
        return 0
    run()
    return max(0, _status_kib("VmHWM") - before) * 1024


def cache_budget(config: EngineConfig, device: torch.device, step_bytes: int, reserved_bytes: int) -> float:
    """The bytes the KV and state caches may take once the largest step (``step_bytes`` at its peak) and the
    features' reservations not allocated yet (``reserved_bytes``) are counted: on CUDA what is left of
    ``--gpu-memory-utilization``'s share of the device; on CPU ``--cpu-kv-cache-gib``, or what the machine has left
    where that is less."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return float(free - (1 - config.gpu_memory_utilization) * total - step_bytes - reserved_bytes)
    asked = config.cpu_kv_cache_gib * 2**30
    available = _available_bytes()
    if available is None:
        return asked
    # A group's ranks started here (``mp``) share the machine: each its part of what is left. Ray's may be elsewhere.
    here = config.world_size if config.distributed_executor_backend == "mp" else 1
    room = available // here - step_bytes - reserved_bytes
    if room < asked:
        logger.warning(
            "--cpu-kv-cache-gib %.2f: this machine has %.2f GiB left beside the largest step (%.0f MiB at its peak) "
            "and the features' reservations (%.0f MiB); the caches take that",
            config.cpu_kv_cache_gib, max(room, 0) / 2**30, step_bytes / 2**20, reserved_bytes / 2**20,
        )  # fmt: skip
        return float(max(room, 0))
    return asked


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    for line in STATUS.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise OSError(f"no {field} in {STATUS}")


def _available_bytes() -> int | None:
    """The memory the machine can still give without swapping (``MemAvailable``), or ``None`` where unknown."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
