"""A hard crash for tests: a server started with this folder first on its PYTHONPATH and
``BATCHGEN_TEST_CRASH_MARKER=14,15,16`` kills itself (SIGKILL, as a crash in native code or the OOM killer would)
when its model's forward sees those token ids in a row. Python imports ``sitecustomize`` at start-up."""

from __future__ import annotations

import os

_MARKER = os.environ.get("BATCHGEN_TEST_CRASH_MARKER")

if _MARKER:
    import signal
    from typing import Any

    from transformers import LlamaModel

    marker = [int(token) for token in _MARKER.split(",")]
    forward = LlamaModel.forward

    def crashing(self: LlamaModel, input_ids: Any = None, **kwargs: Any) -> Any:
        if input_ids is not None:
            ids = input_ids[0].tolist()
            if any(ids[i : i + len(marker)] == marker for i in range(len(ids) - len(marker) + 1)):
                os.kill(os.getpid(), signal.SIGKILL)
        return forward(self, input_ids=input_ids, **kwargs)

    LlamaModel.forward = crashing  # type: ignore[method-assign]
