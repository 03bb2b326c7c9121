"""A request the server cannot run as asked."""

from __future__ import annotations


class RequestRejected(Exception):
    """It becomes an error line in a batch, or the error answer of an online request (``status_code``, default 400)."""

    def __init__(self, code: str, message: str, param: str | None = None, *, status_code: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.status_code = status_code
