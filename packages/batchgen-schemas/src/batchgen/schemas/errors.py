"""The error envelope every non-2xx response carries: ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from ._base import Wire


class ErrorDetail(Wire, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Wire, kw_only=True):
    error: ErrorDetail
