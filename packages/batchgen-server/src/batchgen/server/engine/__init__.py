"""batchgen's continuous-batching engine over Hugging Face transformers (see docs/engine.md).

The names below load on first use, so that importing ``engine.config`` (the flags of ``--help``) does not import
torch and transformers; and transformers, once imported, leaves torchao out (``deferred_imports.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .loading.deferred_imports import defer_torchao

defer_torchao()

if TYPE_CHECKING:
    from .config import EngineConfig
    from .core.encoder_engine import EncoderEngine
    from .core.engine import LLMEngine
    from .factory import build_engine
    from .interface import EngineClient, EngineStats, ServedModel, SteppingEngine
    from .request import CompletionOutput, EngineError, EngineRequest, EngineResult, SamplingParams, TokenLogprob
    from .worker import EngineWorker

_MODULES = {
    "CompletionOutput": ".request",
    "EncoderEngine": ".core.encoder_engine",
    "EngineConfig": ".config",
    "EngineError": ".request",
    "EngineRequest": ".request",
    "EngineResult": ".request",
    "EngineClient": ".interface",
    "EngineStats": ".interface",
    "ServedModel": ".interface",
    "SteppingEngine": ".interface",
    "build_engine": ".factory",
    "EngineWorker": ".worker",
    "LLMEngine": ".core.engine",
    "SamplingParams": ".request",
    "TokenLogprob": ".request",
}

__all__ = [
    "CompletionOutput",
    "EncoderEngine",
    "EngineClient",
    "EngineConfig",
    "EngineError",
    "EngineRequest",
    "EngineResult",
    "EngineStats",
    "EngineWorker",
    "LLMEngine",
    "SamplingParams",
    "ServedModel",
    "SteppingEngine",
    "TokenLogprob",
    "build_engine",
]


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name], __name__), name)
