"""Load a model and its tokenizer: the demo model, a local directory or a hub id."""

from __future__ import annotations

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .config import EngineConfig
from .demo_model import demo_model_dir


def resolve_model_path(model: str) -> str:
    return str(demo_model_dir()) if model == "demo" else model


def load_model(config: EngineConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, bool]:
    """Return the model, its tokenizer and whether it is a causal LM (``False`` for encoder-only embedders)."""
    path = resolve_model_path(config.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    kwargs: dict[str, object] = {"dtype": config.resolved_dtype()}
    if config.device_map is not None:
        kwargs["device_map"] = config.device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        causal = True
    except ValueError:  # not a causal LM (e.g. a BERT-style embedding model)
        model = AutoModel.from_pretrained(path, **kwargs)
        causal = False
    if config.device_map is None:
        model = model.to(config.resolved_device())
    model.eval()
    torch.set_grad_enabled(False)
    return model, tokenizer, causal
