"""Quantized models (docs/server.md, Quantization): which of transformers' quantization methods the engine serves on
which device, each other one refused at load in one line that names it and says what to use instead; the
quantization of a float checkpoint as it loads (``--quantization``, vLLM's switch); the KV cache's dtype
(``--kv-cache-dtype``).

A method served runs through its library's own modules and kernels; the engine's fast paths step aside for its
weights (``fast_paths.plain_tensor``), and the load-time self-check compares it with the model's own forward."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig

from ..config import KV_CACHE_DTYPES
from ..errors import ModelLoadError

ON_CPU = "on CPU quantize the float checkpoint with --quantization torchao (int8) or --quantization bitsandbytes"
"""What a refusal on CPU offers instead."""

CUDA_ONLY = {
    "fp8": "fp8 (FineGrainedFP8) needs a CUDA GPU with compute capability >= 8.9",
    "mxfp8": "mxfp8 (FineGrainedFP8) needs a CUDA GPU with compute capability >= 8.9",
    "fbgemm_fp8": "fbgemm_fp8 needs a CUDA GPU (fbgemm-gpu's kernels)",
    "gptq": "GPTQ needs a CUDA GPU (gptqmodel's Marlin/ExLlama kernels)",
    "awq": "AWQ needs a CUDA GPU (its GEMM kernels)",
    "mxfp4": "mxfp4 needs a CUDA GPU (triton_kernels)",
    "nvfp4": "nvfp4 needs a CUDA GPU with compute capability >= 10.0",
}
"""Methods whose kernels are GPU kernels, each with its reason; refused on CPU (where transformers would dequantize
some of them to a 16-bit model of twice the memory, or fail deep inside its loading)."""

ON_CPU_METHODS = ("bitsandbytes", "torchao", "compressed-tensors")
"""Methods served on CPU (through their library's CPU kernels, or compressed-tensors' decompressed weights)."""

TORCHAO_ON_CPU = ("Int8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig", "Float8WeightOnlyConfig")
"""torchao's configs whose tensors run on CPU (torchao 0.18's int4 packing formats are GPU kernels)."""

KV_DTYPES: dict[str, torch.dtype | None] = dict(
    zip(
        KV_CACHE_DTYPES,  # the flag's names, declared with it (config.py imports no torch)
        (None, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2),
        strict=True,
    )
)
"""The dtype each ``--kv-cache-dtype`` names (``None``: the model's)."""


def method_of(config: PretrainedConfig) -> str | None:
    """The checkpoint's quantization method (``quant_method`` of its config's ``quantization_config``), or ``None``
    for a float checkpoint."""
    return _method(getattr(config, "quantization_config", None))


def _method(quantization: Any) -> str | None:
    """A quantization config's method: its config.json dict's ``quant_method``, or a transformers config object's."""
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
    return str(getattr(method, "value", method))


def check(quantization: Any, device: torch.device) -> None:
    """``ModelLoadError`` (one line: the method, why, what instead) if ``quantization`` (a checkpoint's
    ``quantization_config``, or ``--quantization``'s) cannot run on ``device``."""
    method = _method(quantization)
    if method is None or device.type == "cuda":  # on a GPU transformers' quantizers run, or say what they need
        return
    if method in CUDA_ONLY:
        raise ModelLoadError(f"{CUDA_ONLY[method]}; {ON_CPU}")
    if method not in ON_CPU_METHODS:
        raise ModelLoadError(
            f"{method} checkpoints are not served on CPU (there: {', '.join(ON_CPU_METHODS)}); {ON_CPU}"
        )
    if method == "torchao":
        kind = _torchao_config(quantization)
        if kind not in TORCHAO_ON_CPU:
            raise ModelLoadError(
                f"torchao {kind} needs a CUDA GPU (its tensors have GPU kernels only); on CPU use torchao's "
                f"{', '.join(TORCHAO_ON_CPU)}, or {ON_CPU.removeprefix('on CPU ')}"
            )


def _torchao_config(quantization: Any) -> str:
    """The name of a torchao checkpoint's config (``Int8WeightOnlyConfig``...): in its config.json, or an object."""
    quant_type = quantization["quant_type"] if isinstance(quantization, dict) else quantization.quant_type
    if isinstance(quant_type, dict):  # serialized: {"default": {"_type": "Int8WeightOnlyConfig", ...}}
        quant_type = quant_type.get("default", quant_type)
        return str(quant_type.get("_type", quant_type))
    return type(quant_type).__name__ if not isinstance(quant_type, str) else quant_type


def in_flight(method: str, config: PretrainedConfig, device: torch.device, dtype: torch.dtype) -> Any:
    """The transformers quantization config that quantizes the float checkpoint of ``config`` as it loads
    (``--quantization``): bitsandbytes is 4-bit nf4 (vLLM's in-flight bitsandbytes), torchao int8 weight-only, fp8
    FineGrainedFP8 (a GPU's). ``ModelLoadError`` for a checkpoint quantized otherwise, or a method this device lacks."""
    present = method_of(config)
    if present is not None and present != method:
        raise ModelLoadError(
            f"--quantization {method}: the checkpoint is already quantized with {present}; drop --quantization, "
            "or give the float checkpoint"
        )
    if present is not None:
        return None  # the checkpoint's own quantization_config serves
    if method == "bitsandbytes":
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    if method == "torchao":
        from transformers import TorchAoConfig

        try:
            from torchao.quantization import Int8WeightOnlyConfig
        except ImportError:
            raise ModelLoadError("--quantization torchao needs torchao: pip install 'batchgen-server[quant]'") from None
        return TorchAoConfig(quant_type=Int8WeightOnlyConfig())
    if device.type != "cuda":
        raise ModelLoadError(f"--quantization fp8: {CUDA_ONLY['fp8']}; {ON_CPU}")
    from transformers import FineGrainedFP8Config

    return FineGrainedFP8Config()


def kv_cache_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The KV cache's dtype for ``--kv-cache-dtype`` ``name`` (``None`` for ``auto``: each layer's own); an fp8 cache
    is refused (``ModelLoadError``) where the attention kernels cannot read it."""
    dtype = KV_DTYPES[name]
    if dtype is not None and dtype.itemsize == 1:
        where = "on CPU" if device.type != "cuda" else "by batchgen's attention kernels yet"
        raise ModelLoadError(
            f"--kv-cache-dtype {name}: an fp8 KV cache is not supported {where}; use bfloat16 or float16 for a "
            "16-bit cache"
        )
    return dtype
