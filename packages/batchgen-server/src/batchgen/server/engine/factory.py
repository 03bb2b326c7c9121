"""The engine a model calls for: ``LLMEngine`` for a causal LM, checked against the model's own forward
(``self_check.py``), or for a decoder served as a pooling model (an embedding model, a classifier, a reranker:
``pooling_spec.py``); ``EncoderEngine`` for a BERT-style encoder or cross-encoder."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .config import EngineConfig
from .core.encoder_engine import EncoderEngine
from .core.engine import LLMEngine
from .distributed.group import RankGroup
from .errors import ModelLoadError, refused
from .features.adapters import Adapters
from .features.multimodal.families import check_driven
from .features.pooling import pooler_for
from .loading.loader import load_model
from .loading.pooling_spec import PoolingSpec, spec_of
from .ops.fast_paths import describe
from .self_check import check_engine

logger = logging.getLogger(__name__)


def build_engine(config: EngineConfig) -> LLMEngine | EncoderEngine:
    """Load ``config.model`` and its engine (``ModelLoadError`` in one line if it cannot be served)."""
    if config.enable_lora:
        Adapters.of(config)  # an adapter that cannot be served is refused before the model loads
    try:
        spec = spec_of(config)
    except (OSError, ValueError):
        load_model(config)  # says in one line why it cannot be loaded
        raise
    check_driven(config)
    name = config.served_model_names[0]
    group: RankGroup | None = None
    starting: AbstractContextManager[None] = nullcontext()
    if config.world_size > 1:  # the model split over ranks, one process each (distributed/)
        if spec.encoder or spec.pooling_only:
            raise ModelLoadError(f"{config.split_flags}: encoder and pooling models are served by one process")
        group, model, tokenizer = RankGroup.start(config)
        starting = group.starting()
    else:
        model, tokenizer = load_model(config, model_class(spec))
    with starting:
        if spec.encoder:
            return EncoderEngine(model, tokenizer, config, name, spec)
        pooler = pooler_for(spec, model, tokenizer)
        try:
            engine = LLMEngine(model, tokenizer, config, name, pooler, spec.pooling_only, group)
        except Exception as exc:  # the probe says why in one line; anything else it meets must be one line too
            raise refused(type(model).__name__, "the engine could not be built for it", exc) from None
        if config.self_check and not spec.pooling_only:  # it runs the first steps, so it compiles what they need first
            check_engine(engine)
    logger.info("%s: served as %s; fast paths: %s", name, spec.kind, describe(engine.runner.paths))
    return engine


def model_class(spec: PoolingSpec) -> Any:
    """The auto class a model served as ``spec`` loads with: no LM head where none is used; a generator's is the
    loader's choice (a causal LM, or a vision-language model's class)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    if spec.kind == "generate":
        return None
    if spec.kind in ("classify", "reward"):
        return AutoModelForSequenceClassification
    return AutoModel if spec.kind == "embed" else AutoModelForCausalLM
