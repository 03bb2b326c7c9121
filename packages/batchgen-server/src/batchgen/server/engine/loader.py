"""Load a model and its tokenizer (demo, a local directory or a hub id): a causal LM or a BERT-style encoder."""

from __future__ import annotations

from pathlib import Path

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from .config import EngineConfig
from .demo_model import demo_model_dir
from .errors import ModelLoadError


def resolve_model_path(model: str) -> str:
    return str(demo_model_dir()) if model == "demo" else model


def is_encoder_only(config: PretrainedConfig) -> bool:
    """BERT, RoBERTa, MiniLM, E5, BGE, ...: a masked-LM family used as neither a decoder nor an encoder-decoder.

    (``is_decoder`` alone cannot tell: decoder-only configs such as Llama's leave it ``False``.)
    """
    return (
        config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        and not config.is_decoder
        and not config.is_encoder_decoder
    )


def load_model(config: EngineConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and its tokenizer; ``ModelLoadError`` (one line: what was tried, what to do) if they cannot load."""
    path = resolve_model_path(config.model)
    kwargs: dict[str, object] = {"dtype": config.resolved_dtype()}
    if config.device_map is not None:
        kwargs["device_map"] = config.device_map
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model_class = AutoModel if is_encoder_only(AutoConfig.from_pretrained(path)) else AutoModelForCausalLM
        model = model_class.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:  # transformers' errors for missing files, unknown ids, bad configs
        raise ModelLoadError(_why_not_loaded(config.model, exc)) from exc
    if config.device_map is None:
        model = model.to(config.resolved_device())
    model.eval()
    return model, tokenizer


def _why_not_loaded(model: str, exc: Exception) -> str:
    # A hub id is "org/name"; anything else, or an "org/name" whose first part is a local directory, is a path.
    local = model.startswith((".", "/", "~")) or model.count("/") != 1 or Path(model.split("/")[0]).is_dir()
    if local and not Path(model).expanduser().exists():
        return (
            f"no model at {model!r}: that directory does not exist (give a directory holding config.json, "
            "or a Hugging Face hub id such as Qwen/Qwen2.5-0.5B-Instruct)"
        )
    detail = next(iter(str(exc).strip().splitlines()), type(exc).__name__)
    return (
        f"could not load the model {model!r}: {detail} (check the hub id or the directory, and that this machine "
        "can reach the hub, or that the model is in the local cache with HF_HUB_OFFLINE=1)"
    )
