"""The engine a model calls for: ``LLMEngine`` for a causal LM, ``EncoderEngine`` for a BERT-style encoder."""

from __future__ import annotations

from .adapters import Adapters
from .config import EngineConfig
from .encoder_engine import EncoderEngine
from .engine import LLMEngine
from .loader import is_encoder_only, load_model


def build_engine(config: EngineConfig) -> LLMEngine | EncoderEngine:
    """Load ``config.model`` and its engine (``ModelLoadError`` in one line if it cannot be served)."""
    if config.enable_lora:
        Adapters.of(config)  # an adapter that cannot be served is refused before the model loads
    model, tokenizer = load_model(config)
    engine_class = EncoderEngine if is_encoder_only(model.config) else LLMEngine
    return engine_class(model, tokenizer, config, config.served_model_names[0])
