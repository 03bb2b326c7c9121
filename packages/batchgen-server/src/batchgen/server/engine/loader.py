"""Load a model and its tokenizer (demo, a local directory or a hub id): a causal LM or a BERT-style encoder."""

from __future__ import annotations

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
    path = resolve_model_path(config.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    kwargs: dict[str, object] = {"dtype": config.resolved_dtype()}
    if config.device_map is not None:
        kwargs["device_map"] = config.device_map
    model_class = AutoModel if is_encoder_only(AutoConfig.from_pretrained(path)) else AutoModelForCausalLM
    model = model_class.from_pretrained(path, **kwargs)
    if config.device_map is None:
        model = model.to(config.resolved_device())
    model.eval()
    return model, tokenizer
