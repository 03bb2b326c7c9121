"""Load a model and its tokenizer (demo, a local directory or a hub id): a causal LM or a BERT-style encoder; and the
sampling defaults of its generation config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from ..config import EngineConfig
from ..errors import ModelLoadError
from .demo_model import demo_model_dir
from .quantization import check, in_flight, kv_cache_dtype, method_of
from .split import loading, shard_kwargs

GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""The generation config's sampling fields that become defaults (as vLLM takes them), and the request field each
stands for. ``do_sample`` is ignored, as vLLM does: a temperature the model ships is used."""


def is_vision_language(config: PretrainedConfig) -> bool:
    """A model that reads images: an image-text-to-text family with a vision tower."""
    return config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and hasattr(config, "vision_config")


def resolve_model_path(model: str) -> str:
    return str(demo_model_dir()) if model == "demo" else model


def is_encoder_only(config: PretrainedConfig) -> bool:
    """BERT, RoBERTa, MiniLM, E5, BGE, ...: a masked-LM family used as neither a decoder nor an encoder-decoder.

    (``is_decoder`` alone cannot tell: decoder-only configs such as Llama's leave it ``False``.)
    """
    return (
        config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        and not getattr(config, "is_decoder", False)  # ModernBERT's config has neither
        and not getattr(config, "is_encoder_decoder", False)
    )


def load_model(config: EngineConfig, model_class: Any = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and its tokenizer; ``ModelLoadError`` (one line: what was tried, what to do) if they cannot load.
    ``model_class``: the auto class to load it with (default: ``AutoModel`` for an encoder, else
    ``AutoModelForCausalLM``)."""
    path = resolve_model_path(config.model)
    hub: dict[str, Any] = {"revision": config.revision, "trust_remote_code": config.trust_remote_code}
    # No Hub kernels (``kernels``, on by default from transformers 5.25): they would be fetched from the Hub at load and
    # swap layers' code for theirs; the engine runs the model's own layers (and the kernel packages installed here).
    kwargs: dict[str, Any] = {"dtype": config.resolved_dtype(), "use_kernels": False, **hub}
    if config.device_map is not None:
        kwargs["device_map"] = config.device_map
    try:
        model_config = AutoConfig.from_pretrained(path, **hub)
    except (OSError, ValueError) as exc:  # transformers' errors for missing files, unknown ids, bad configs
        raise ModelLoadError(_why_not_loaded(config.model, exc)) from exc
    device = config.resolved_device()
    kv_cache_dtype(config.kv_cache_dtype, device)  # refused before the weights load
    if config.quantization is not None and (
        quantize := in_flight(config.quantization, model_config, device, kwargs["dtype"])
    ):
        kwargs["quantization_config"] = quantize
    check(kwargs.get("quantization_config") or getattr(model_config, "quantization_config", None), device)
    if model_class is None:
        model_class = AutoModel if is_encoder_only(model_config) else AutoModelForCausalLM
        if is_vision_language(model_config):  # (a family the engine does not drive is refused by the factory first)
            model_class = AutoModelForImageTextToText
    if config.world_size > 1:  # this rank's shard alone (engine/distributed/)
        kwargs.update(shard_kwargs(config, model_config))
    try:
        with loading(config):  # transformers' TP x PP sharding made to work (``distributed/plan.py``)
            model = model_class.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(_why_not_loaded(config.model, exc)) from exc
    except (ImportError, RuntimeError) as exc:  # a quantizer's library missing, or its kernels absent here
        method = method_of(model_config) or config.quantization
        if method is None:
            raise
        raise ModelLoadError(_why_not_quantized(method, exc)) from exc
    tokenizer = load_tokenizer(config)
    if config.device_map is None and config.world_size == 1:  # a shard is loaded where it runs
        model = model.to(config.resolved_device())
    model.eval()
    return model, tokenizer


def load_tokenizer(config: EngineConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer, or ``--tokenizer``'s, with ``--chat-template`` in place of its own."""
    source = config.tokenizer or config.model
    revision = config.revision if config.tokenizer is None else None  # a revision names a commit of the model
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            resolve_model_path(source), revision=revision, trust_remote_code=config.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(_why_not_loaded(source, exc, "tokenizer")) from exc
    if config.chat_template is not None:
        tokenizer.chat_template = read_chat_template(config.chat_template)
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False)
        except Exception as exc:  # jinja2's syntax and template errors, and whatever the template raises
            raise ModelLoadError(f"--chat-template cannot render a one-message conversation: {exc}") from exc
    return tokenizer


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file's content, or the template itself (as vLLM reads it)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in value:
        raise ModelLoadError(
            f"--chat-template {value!r}: no such file, and not a template either (a Jinja template has '{{' in it)"
        )
    return value


def input_embeddings(model: PreTrainedModel) -> torch.Tensor:
    """The weight of the model's input embeddings: its vocabulary's rows, on the device its inputs go to."""
    weight = model.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor)
    return weight


def model_weight(model: PreTrainedModel) -> torch.Tensor:
    """A weight on the device and in the dtype the model's inputs go to: its input embeddings', or a later pipeline
    stage's first (it holds no embeddings: ``distributed/stages.py``)."""
    weight = getattr(model.get_input_embeddings(), "weight", None)
    return weight if isinstance(weight, torch.Tensor) else next(model.parameters())


def load_generation_defaults(config: EngineConfig) -> dict[str, Any]:
    """The sampling defaults of ``--generation-config`` (``auto``: the model's generation_config.json), keyed by
    request field; empty for ``none``/``vllm``, or a model with no generation config."""
    choice = config.generation_config
    if choice in ("none", "vllm"):
        return {}
    source, revision = (resolve_model_path(config.model), config.revision) if choice == "auto" else (choice, None)
    try:
        generation = GenerationConfig.from_pretrained(source, revision=revision or "main")
    except OSError as exc:
        if choice == "auto":
            return {}  # the model ships none
        raise ModelLoadError(f"--generation-config {choice!r}: no generation_config.json there ({exc})") from exc
    values = {field: getattr(generation, name, None) for name, field in GENERATION_DEFAULTS.items()}
    return {field: value for field, value in values.items() if value is not None}


def _why_not_quantized(method: str, exc: Exception) -> str:
    detail = next(iter(str(exc).strip().splitlines()), type(exc).__name__)
    return (
        f"the {method} quantization cannot load here: {detail} (pip install 'batchgen-server[quant]' for the CPU "
        "methods; docs/server.md lists what runs where)"
    )


def _why_not_loaded(model: str, exc: Exception, what: str = "model") -> str:
    if "trust_remote_code" in str(exc):
        return (
            f"the {what} {model!r} ships its own Python code (auto_map): pass --trust-remote-code to run it, if you "
            "trust its source"
        )
    # A hub id is "org/name"; anything else, or an "org/name" whose first part is a local directory, is a path.
    local = model.startswith((".", "/", "~")) or model.count("/") != 1 or Path(model.split("/")[0]).is_dir()
    if local and not Path(model).expanduser().exists():
        return (
            f"no {what} at {model!r}: that directory does not exist (give a directory holding config.json, "
            "or a Hugging Face hub id such as Qwen/Qwen2.5-0.5B-Instruct)"
        )
    detail = next(iter(str(exc).strip().splitlines()), type(exc).__name__)
    return (
        f"could not load the {what} {model!r}: {detail} (check the hub id or the directory, and that this machine "
        "can reach the hub, or that the model is in the local cache with HF_HUB_OFFLINE=1)"
    )
