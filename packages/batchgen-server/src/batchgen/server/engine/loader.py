"""Load a causal LM and its tokenizer: the demo model, a local directory or a hub id."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .config import EngineConfig
from .demo_model import demo_model_dir


def resolve_model_path(model: str) -> str:
    return str(demo_model_dir()) if model == "demo" else model


def load_model(config: EngineConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    path = resolve_model_path(config.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    kwargs: dict[str, object] = {"dtype": config.resolved_dtype()}
    if config.device_map is not None:
        kwargs["device_map"] = config.device_map
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if config.device_map is None:
        model = model.to(config.resolved_device())
    model.eval()
    return model, tokenizer
