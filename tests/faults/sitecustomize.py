"""A hard crash for tests: a server started with this folder first on its PYTHONPATH and
``BATCHGEN_TEST_CRASH_MARKER=14,15,16`` kills itself (SIGKILL, as a crash in native code or the OOM killer would)
when its model's forward sees those token ids in a row. Python imports ``sitecustomize`` at start-up; the patch is
applied when the Llama model's module is imported, so that the processes that never load one (Ray's own helpers,
which start with this environment too) pay nothing for it."""

from __future__ import annotations

import os
from typing import Any

_MARKER = os.environ.get("BATCHGEN_TEST_CRASH_MARKER")
_FAIL_RANK = os.environ.get("BATCHGEN_TEST_FAIL_RANK")
"""A tensor-parallel rank that cannot start: the rank of that number (its ``RANK``) fails as it loads the model."""
LLAMA = "transformers.models.llama.modeling_llama"


def patch(module: object) -> None:
    import signal

    if _FAIL_RANK and os.environ.get("RANK") == _FAIL_RANK:
        raise MemoryError(f"injected: out of memory on rank {_FAIL_RANK}")
    if not _MARKER:
        return
    marker = [int(token) for token in (_MARKER or "").split(",")]
    model: Any = module.LlamaModel  # type: ignore[attr-defined]
    forward = model.forward

    def crashing(self: Any, input_ids: Any = None, **kwargs: Any) -> Any:
        if input_ids is not None:
            ids = input_ids[0].tolist()
            if any(ids[i : i + len(marker)] == marker for i in range(len(ids) - len(marker) + 1)):
                os.kill(os.getpid(), signal.SIGKILL)
        return forward(self, input_ids=input_ids, **kwargs)

    model.forward = crashing


if _MARKER or _FAIL_RANK:
    import importlib.abc
    import importlib.machinery
    import sys

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != LLAMA:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                loader = spec.loader

                class _Patched(importlib.abc.Loader):
                    def create_module(self, spec: Any) -> Any:
                        return loader.create_module(spec)

                    def exec_module(self, module: Any) -> None:
                        loader.exec_module(module)
                        patch(module)

                spec.loader = _Patched()
            return spec

    if LLAMA in sys.modules:
        patch(sys.modules[LLAMA])
    else:
        sys.meta_path.insert(0, _PatchOnImport())
