"""batchgen's continuous-batching engine over Hugging Face transformers (see docs/engine.md)."""

from .config import EngineConfig
from .encoder_engine import EncoderEngine
from .engine import EngineStats, LLMEngine
from .request import CompletionOutput, EngineError, EngineRequest, EngineResult, SamplingParams, TokenLogprob
from .worker import EngineWorker

__all__ = [
    "CompletionOutput",
    "EncoderEngine",
    "EngineConfig",
    "EngineError",
    "EngineRequest",
    "EngineResult",
    "EngineStats",
    "EngineWorker",
    "LLMEngine",
    "SamplingParams",
    "TokenLogprob",
]
