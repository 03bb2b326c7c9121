"""batchgen's continuous-batching engine over Hugging Face transformers (see docs/engine.md)."""

from .config import EngineConfig
from .engine import EngineStats, LLMEngine
from .request import CompletionOutput, EngineError, EngineRequest, EngineResult, SamplingParams, TokenLogprob
from .worker import EngineWorker

__all__ = [
    "CompletionOutput",
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
