"""An image part the server will not take: a 400 naming the part (an error line in a batch), or a 429 when the
server has no room for its pixels now."""

from __future__ import annotations


class MediaError(ValueError):
    def __init__(self, code: str, message: str, param: str | None, *, status_code: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.status_code = status_code
