"""Every knob of the engine in one place."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class EngineConfig:
    model: str = "demo"
    """``"demo"`` (a tiny random model built in code), a local directory or a Hugging Face hub id."""
    device: str | None = None
    """``None`` picks ``cuda`` when available, else ``cpu``."""
    dtype: str = "auto"
    """``auto`` is bfloat16 on GPU and float32 on CPU; or ``float32``, ``float64``, ``bfloat16``, ``float16``."""
    device_map: str | None = None
    """``"auto"`` spreads a model too large for one GPU over the available devices (accelerate)."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_kv_blocks: int | None = None
    """KV blocks to allocate; ``None`` sizes them from free GPU memory (CUDA) or from ``cpu_kv_cache_gib`` (CPU)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of total GPU memory the model plus the KV cache may use (CUDA only)."""
    cpu_kv_cache_gib: float = 1.0
    """KV cache size on CPU when ``num_kv_blocks`` is unset."""
    max_num_seqs: int = 256
    """Most sequences running in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decode tokens plus prefill chunks."""
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    """Context cap; ``None`` uses the model's own ``max_position_embeddings``."""
    seed: int = 0
    """Seed of requests that set none (each request gets its own generator)."""
    attention_backend: str = "auto"
    """``gather`` (contexts copied into a buffer, then SDPA: fastest on CPU), ``flex`` (FlexAttention reading the
    paged cache in place, compiled on CUDA), or ``auto``: flex on CUDA, gather elsewhere."""
    enforce_eager: bool = False
    """Run everything eagerly: no ``torch.compile`` (the in-place decode attention, FlexAttention) and no CUDA
    graphs. Models under 10M parameters (the demo model) always run eagerly: compiling takes seconds and their
    steps are too small to gain from it."""
    self_check: bool = True
    """At load, run a few tokens through the engine and through the model's own forward, and refuse the model if
    they disagree (about a second on a large model on a GPU)."""
    torch_threads: int | None = None
    """CPU threads of torch's ops (process-wide); ``None`` keeps torch's default (the machine's cores)."""

    def apply_torch_threads(self) -> None:
        if self.torch_threads is not None:
            torch.set_num_threads(self.torch_threads)

    def resolved_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        return dtype
