"""Why a model cannot be served: errors whose message is one line that says what was tried and what to do."""

from __future__ import annotations


class ModelLoadError(Exception):
    """The model could not be loaded (a path that does not exist, a hub id that cannot be reached, a bad dtype)."""


class ModelNotSupported(ModelLoadError):
    """The engine cannot drive this model correctly, so it refuses it at load rather than serve wrong text."""

    def __init__(self, architecture: str, reason: str) -> None:
        super().__init__(f"batchgen cannot serve {architecture} models: {reason}")
        self.architecture = architecture
        self.reason = reason


class GroupFailed(RuntimeError):
    """A rank of a tensor-parallel group died, hung past the collective timeout, or failed within a forward that
    every rank runs: the ranks are no longer in step, so the whole group is started again (the engine worker's
    restart), not one request failed."""
