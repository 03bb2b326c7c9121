"""The engine a model calls for: ``LLMEngine`` for a causal LM, checked against the model's own forward
(``self_check.py``), or ``EncoderEngine`` for a BERT-style encoder."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

from .adapters import Adapters
from .config import EngineConfig
from .distributed.group import RankGroup
from .encoder_engine import EncoderEngine
from .engine import LLMEngine
from .errors import ModelLoadError, refused
from .fast_paths import describe
from .loader import is_encoder_only, load_model
from .self_check import check_engine

logger = logging.getLogger(__name__)


def build_engine(config: EngineConfig) -> LLMEngine | EncoderEngine:
    """Load ``config.model`` and its engine (``ModelLoadError`` in one line if it cannot be served)."""
    if config.enable_lora:
        Adapters.of(config)  # an adapter that cannot be served is refused before the model loads
    name = config.served_model_names[0]
    group: RankGroup | None = None
    starting: AbstractContextManager[None] = nullcontext()
    if config.tensor_parallel_size > 1:  # the model split over ranks, one process each (distributed/)
        group, model, tokenizer = RankGroup.start(config)
        starting = group.starting()
    else:
        model, tokenizer = load_model(config)
    with starting:
        if is_encoder_only(model.config):
            if group is not None:
                raise ModelLoadError("--tensor-parallel-size: encoder models are served by one process")
            return EncoderEngine(model, tokenizer, config, name)
        try:
            engine = LLMEngine(model, tokenizer, config, name, group)
        except Exception as exc:  # the probe says why in one line; anything else it meets must be one line too
            raise refused(type(model).__name__, "the engine could not be built for it", exc) from None
        if config.self_check:  # it runs the first steps, so it compiles what they need before the first request
            check_engine(engine)
    logger.info("%s: fast paths: %s", name, describe(engine.runner.paths))
    return engine
