"""Why the engine refuses a model: one line that names the architecture and the reason."""

from __future__ import annotations


class ModelNotSupported(Exception):
    """The engine cannot drive this model correctly, so it refuses it at load rather than serve wrong text."""

    def __init__(self, architecture: str, reason: str) -> None:
        super().__init__(f"batchgen cannot serve {architecture} models: {reason}")
        self.architecture = architecture
        self.reason = reason
