"""An image part the server will not take: a 400 naming the part (an error line in a batch)."""

from __future__ import annotations


class MediaError(ValueError):
    def __init__(self, code: str, message: str, param: str | None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
