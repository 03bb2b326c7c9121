"""Why a model cannot be served: errors whose message is one line that says what was tried and what to do."""

from __future__ import annotations

import logging
import traceback
from pathlib import Path

logger = logging.getLogger(__name__)


class ModelLoadError(Exception):
    """The model could not be loaded (a path that does not exist, a hub id that cannot be reached, a bad dtype)."""


class ModelNotSupported(ModelLoadError):
    """The engine cannot drive this model correctly, so it refuses it at load rather than serve wrong text."""

    def __init__(self, architecture: str, reason: str) -> None:
        super().__init__(f"batchgen cannot serve {architecture} models: {reason}")
        self.architecture = architecture
        self.reason = reason


def one_line(exc: BaseException) -> str:
    """``exc`` as one line: its type, the first line of its message and where it was raised (the innermost frame's
    file and line), e.g. ``TypeError: 'NoneType' object is not subscriptable (modeling_deepseek_v32.py:441)``."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        text += f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})"
    return text


def refused(architecture: str, what: str, exc: BaseException) -> ModelLoadError:
    """What an unexpected exception becomes where the engine runs the model at load (the layer probe, the
    self-check): the one-line refusal ``what: exc``, never a traceback. A ``ModelLoadError`` already says why: it is
    kept."""
    if isinstance(exc, ModelLoadError):
        return exc
    logger.debug("%s: %s", architecture, what, exc_info=exc)  # the traceback, for whoever debugs it
    return ModelNotSupported(architecture, f"{what}: {one_line(exc)}")


class GroupFailed(RuntimeError):
    """A rank of a tensor-parallel group died, hung past the collective timeout, or failed within a forward that
    every rank runs: the ranks are no longer in step, so the whole group is started again (the engine worker's
    restart), not one request failed."""
