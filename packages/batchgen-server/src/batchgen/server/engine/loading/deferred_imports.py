"""An import transformers makes that a process serving no such model does not need, deferred.

transformers imports torchao (0.7 s of every process that loads a model) whenever torchao is installed, as it
imports its quantizers, for one function that saves a torchao checkpoint. A finder on ``sys.meta_path`` runs that
quantizer's module with torchao reported missing, then gives it back the real check (a torchao checkpoint still
loads) and a function that imports torchao on its first call. bitsandbytes and compressed-tensors are imported on
use already.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

TORCHAO_QUANTIZER = "transformers.quantizers.quantizer_torchao"


def defer_torchao() -> None:
    """Install the finder (once; a no-op once the quantizer is imported)."""
    if TORCHAO_QUANTIZER not in sys.modules and not any(isinstance(f, _TorchaoFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchaoFinder())


class _TorchaoFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != TORCHAO_QUANTIZER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _WithoutTorchao(spec.loader)
        return spec


class _WithoutTorchao(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        utils: Any = importlib.import_module("transformers.utils")
        available = utils.is_torchao_available
        utils.is_torchao_available = _missing
        try:
            self.loader.exec_module(module)
        finally:
            utils.is_torchao_available = available
        quantizer: Any = module
        quantizer.is_torchao_available = available
        quantizer.flatten_tensor_state_dict = _flatten_tensor_state_dict


def _missing(*args: Any, **kwargs: Any) -> bool:
    return False


def _flatten_tensor_state_dict(*args: Any, **kwargs: Any) -> Any:
    """torchao's, imported now: only a process that saves a torchao checkpoint pays for it."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    return flatten_tensor_state_dict(*args, **kwargs)
