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
