"""Every knob of the engine in one place, each declared once (``options.setting``): a flag, a ``BATCHGEN_*``
variable, a default and a help text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..options import setting

if TYPE_CHECKING:  # torch loads in seconds: only when a model is
    import torch


DTYPE_ALIASES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float64": "float64",
}
"""What ``--dtype`` accepts besides ``auto``, and the torch dtype each names."""

QUANTIZATION_METHODS = ("bitsandbytes", "torchao", "fp8")
"""What ``--quantization`` takes (vLLM's in-flight methods that a transformers quantizer provides)."""

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
"""What ``--kv-cache-dtype`` takes (vLLM's names; ``quantization.py`` says which a device can hold)."""

TASKS = ("auto", "generate", "embed", "classify", "reward", "score")
"""What ``--task`` takes (vLLM's names)."""


@dataclass(slots=True)
class EngineConfig:
    model: str = setting(
        "demo", "'demo' (a tiny random model built in code), a local directory or a Hugging Face hub id"
    )
    revision: str | None = setting(None, "the model's branch, tag or commit on the hub (default: main)")
    trust_remote_code: bool = setting(
        False, "run the Python code a model ships with (its auto_map), for architectures transformers lacks"
    )
    tokenizer: str | None = setting(None, "the tokenizer's directory or hub id (default: the model's own)")
    chat_template: str | None = setting(
        None, "a chat template file, or the Jinja template itself, in place of the tokenizer's"
    )
    served_model_name: tuple[str, ...] = setting(
        (),
        "a model name requests may use, repeat for aliases; the first is the model's id (default: --model as given)",
    )
    generation_config: str = setting(
        "auto",
        "sampling defaults for what neither a request nor its batch sets: auto (the model's generation_config.json), "
        "none or vllm (batchgen's own: greedy), or a directory holding a generation_config.json",
    )
    device: str | None = setting(None, "cuda, cuda:1 or cpu (default: cuda when available)")
    dtype: str = setting(
        "auto", "auto (bfloat16 on GPU, float32 on CPU), bfloat16 (bf16), float16 (half, fp16), float32 (fp32), float64"
    )
    quantization: str | None = setting(
        None,
        "quantize a float checkpoint as it loads: bitsandbytes (4-bit nf4), torchao (int8 weight-only) or fp8 "
        "(FineGrainedFP8, CUDA only); a quantized checkpoint is served as it is, without it",
        flags=("--quantization", "-q"),
    )
    kv_cache_dtype: str = setting(
        "auto",
        "the KV cache's dtype: auto (the model's), bfloat16 or float16 (a 16-bit cache, CPU included: twice the "
        "tokens of a float32 model's), fp8, fp8_e4m3 or fp8_e5m2 (refused where the attention kernels cannot read "
        "them)",
    )
    device_map: str | None = setting(None, "'auto' spreads a model too large for one GPU over the devices (accelerate)")
    block_size: int = setting(16, "tokens per KV-cache block")
    num_kv_blocks: int | None = setting(
        None, "KV-cache blocks (default: sized from free GPU memory, or from --cpu-kv-cache-gib on CPU)"
    )
    gpu_memory_utilization: float = setting(0.9, "fraction of GPU memory the model and the KV cache may use")
    cpu_kv_cache_gib: float = setting(1.0, "KV cache size on CPU when --num-kv-blocks is unset")
    max_num_seqs: int = setting(256, "most sequences running in one step")
    max_num_batched_tokens: int = setting(2048, "token budget of one step: decode tokens plus prefill chunks")
    max_mixed_step_ratio: float = setting(
        1.25,
        "a step that carries online requests' decodes takes only the prefill tokens that keep it within about this "
        "many times the same decodes alone (from step times measured as the engine runs): a prompt arriving beside "
        "streams delays their next token by about this factor, and continues in the next steps; steps without "
        "online decodes, with online prompts at least half as many as the streams (a burst), or while batch prompts "
        "are computed or wait, take prefills up to --max-num-batched-tokens; 1 is no bound",
    )
    enable_prefix_caching: bool = setting(
        True, "reuse the KV cache of shared prompt prefixes", flags=("--prefix-caching",)
    )
    state_checkpoint_fraction: float = setting(
        0.1,
        "models with state layers (Mamba, linear attention, short convolutions): the share of the cache's memory kept "
        "for prefix checkpoints of their state, without which their prefix cache finds nothing; 0 turns it off",
    )
    state_checkpoint_interval: int = setting(
        256,
        "models with state layers: a prompt also leaves a checkpoint of its state every this many tokens (a multiple "
        "of --block-size; 0: only at its last block boundary and where it shares a prefix with an earlier prompt)",
    )
    max_model_len: int | None = setting(None, "context cap (default: the model's max_position_embeddings)")
    seed: int = setting(0, "seed of the sampled requests that set none")
    attention_backend: str = setting(
        "auto",
        "gather (decodes read the paged cache in place through a fast kernel, or eagerly from gathered copies; "
        "prefill chunks through SDPA), flex (FlexAttention reading the paged cache in place, compiled on CUDA) or "
        "auto (gather)",
    )
    enforce_eager: bool = setting(
        False,
        "run everything eagerly: no torch.compile and no CUDA graphs (models under 10M parameters, the demo model, "
        "always run eagerly)",
    )
    async_scheduling: str = setting(
        "auto",
        "on: schedule and launch each step before the previous one's tokens are read back, so the host's work "
        "between steps runs while the device computes; off: one step at a time; auto: on for CUDA (on CPU the "
        "host is the device, and nothing overlaps)",
    )
    self_check: bool = setting(
        True,
        "at load, run a few tokens through the engine and through the model's own forward, and refuse the model if "
        "they disagree",
        flags=("--self-check",),
    )
    self_check_budget_s: float = setting(
        180.0,
        "longest the self-check may take to run a prompt past the model's longest sliding window or sparse "
        "selection (estimated from its short part); a model it cannot check that far within it is refused",
    )
    torch_threads: int | None = setting(
        None, "CPU threads of torch's ops, process-wide (default: torch's own, the machine's cores)"
    )
    grammar_timeout_s: float = setting(
        10.0,
        "longest a structured-output grammar (a JSON schema, a regex...) may take to compile; the request is "
        "refused past it",
    )
    enable_lora: bool = setting(
        False, "serve LoRA adapters beside the base model (--lora-modules, or loaded at run time)"
    )
    lora_modules: tuple[str, ...] = setting(
        (),
        "LoRA adapters to serve, each name=path (a PEFT adapter's directory) or vLLM's JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a request\'s model names one',
    )
    encoder_cache_mib: int = setting(
        256,
        "memory for a vision-language model's encoder outputs, kept by image content hash so the same picture in "
        "many requests is encoded once (0: none kept)",
    )
    task: str = setting(
        "auto",
        "what the model is served as where its checkpoint could be either (vLLM's --task): auto (from its "
        "architecture and sentence-transformers config), generate, embed, classify, reward, or score (a causal LM "
        "scores query-document pairs by its 'yes'/'no' logits: Qwen3-Reranker's recipe)",
    )
    runner: str = setting(
        "auto",
        "vLLM's --runner: pooling serves a causal LM as a pooling model only (no LM head, prefill only); generate "
        "or auto leave it to --task",
    )
    max_loras: int = setting(1, "most LoRA adapters in one step (their slots on the device)")
    max_lora_rank: int = setting(16, "highest LoRA rank served (an adapter above it is refused)")
    max_cpu_loras: int | None = setting(
        None, "LoRA adapters whose weights are kept in host memory (default: --max-loras); others are read again"
    )
    allow_runtime_lora_updating: bool = setting(
        False,
        "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on with vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
    )

    tensor_parallel_size: int = setting(
        1,
        "ranks the model is split over, one process each on this node (vLLM's flag): each holds its share of every "
        "layer's heads and of the KV cache; gloo on CPU, NCCL on CUDA (docs/scaling.md)",
        flags=("--tensor-parallel-size", "-tp"),
    )
    pipeline_parallel_size: int = setting(
        1,
        "stages the decoder layers are split into, one process each (vLLM's flag): each holds its contiguous layers "
        "and their share of the KV cache, the first the embeddings, the last the norm and head; composes with "
        "--tensor-parallel-size (a grid of TP x PP ranks; docs/scaling.md)",
        flags=("--pipeline-parallel-size", "-pp"),
    )
    distributed_executor_backend: str = setting(
        "mp",
        "how a group's worker ranks are started (vLLM's flag): mp, a process each on this node; ray, a Ray actor "
        "each, placed by a placement group on the Ray cluster RAY_ADDRESS names (else a private local Ray)",
    )
    enable_expert_parallel: bool = setting(
        False,
        "with --tensor-parallel-size: an MoE model's experts spread over the ranks (each holds whole experts, 1/N of "
        "them) instead of each expert split N ways; attention stays split by heads (vLLM's flag)",
    )
    distributed_timeout_s: float = setting(
        30.0,
        "with --tensor-parallel-size: longest a rank waits for the others in a collective (and for the group to "
        "start) before the group is declared dead and restarted",
    )

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The names requests may use for the model, its id first."""
        return self.served_model_name or (self.model,)

    @property
    def runtime_lora_updating(self) -> bool:
        """Adapters may be loaded and unloaded at run time: the flag, or vLLM's environment variable."""
        import os

        vllm = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true", "yes", "on")
        return self.enable_lora and (self.allow_runtime_lora_updating or vllm)

    def usage_problem(self) -> str | None:
        """Why these flags cannot go together or take that value (a usage error), or ``None``."""
        if self.lora_modules and not self.enable_lora:  # adapters the server would silently not serve
            return "--lora-modules needs --enable-lora"
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            return f"--quantization {self.quantization!r}: use {', '.join(QUANTIZATION_METHODS)}"
        if self.task not in TASKS:
            return f"--task {self.task!r}: use {', '.join(TASKS)}"
        if self.runner not in ("auto", "generate", "pooling"):
            return f"--runner {self.runner!r}: use auto, generate or pooling"
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            return f"--kv-cache-dtype {self.kv_cache_dtype!r}: use {', '.join(KV_CACHE_DTYPES)}"
        for flag, size in self._split_sizes():
            if size < 1:
                return f"{flag} {size}: give 1 (one process) or more"
        if self.distributed_executor_backend not in ("mp", "ray"):
            return f"--distributed-executor-backend {self.distributed_executor_backend!r}: use mp or ray"
        if not self.max_mixed_step_ratio >= 1:  # (NaN too)
            return f"--max-mixed-step-ratio {self.max_mixed_step_ratio}: give 1 (no bound) or more"
        for flag, seconds in (("--distributed-timeout-s", self.distributed_timeout_s),
                              ("--grammar-timeout-s", self.grammar_timeout_s)):  # fmt: skip
            if not seconds > 0:  # (NaN too): a group that times out at once, or never
                return f"{flag} {seconds:g}: give a number of seconds over 0"
        return self._tensor_parallel_problem()

    @property
    def world_size(self) -> int:
        """The ranks of the model's group: a grid of --tensor-parallel-size x --pipeline-parallel-size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def split_flags(self) -> str:
        """The flags that split the model, as given (for messages)."""
        return " ".join(f"{flag} {size}" for flag, size in self._split_sizes() if size > 1)

    def _split_sizes(self) -> list[tuple[str, int]]:
        return [
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
        ]

    def _tensor_parallel_problem(self) -> str | None:
        """What ``--tensor-parallel-size`` cannot go with yet (the model's own split is checked as it loads)."""
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            return "--enable-expert-parallel needs --tensor-parallel-size 2 or more"
        if self.world_size == 1:
            return None
        flags = self.split_flags
        if self.enable_expert_parallel and self.pipeline_parallel_size > 1:
            return f"--enable-expert-parallel with {flags}: experts are spread within one stage only; drop one"
        if self.device_map is not None:
            return f"{flags} with --device-map: give one or the other"
        if self.quantization is not None:
            return f"{flags} with --quantization: quantized shards are not served yet"
        return None

    def uses_async_scheduling(self, device: torch.device) -> bool:
        from .errors import ModelLoadError

        if self.async_scheduling not in ("auto", "on", "off"):
            raise ModelLoadError(f"unknown --async-scheduling {self.async_scheduling!r}: use auto, on or off")
        return self.async_scheduling == "on" or (self.async_scheduling == "auto" and device.type == "cuda")

    def apply_torch_threads(self) -> None:
        import torch

        if self.torch_threads is not None:
            torch.set_num_threads(self.torch_threads)

    def resolved_device(self) -> torch.device:
        import torch

        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def resolved_dtype(self) -> torch.dtype:
        import torch

        from .errors import ModelLoadError

        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        name = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if name not in DTYPE_ALIASES.values():
            raise ModelLoadError(f"unknown dtype {self.dtype!r}: use auto, {', '.join(sorted(DTYPE_ALIASES))}")
        dtype: torch.dtype = getattr(torch, name)
        return dtype
