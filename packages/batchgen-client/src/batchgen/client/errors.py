"""Typed errors: one class per HTTP status family, connection failures, and batch outcomes.

Every error derives from ``BatchGenError``, a ``RuntimeError``, so code written against the original client (which
raised ``RuntimeError`` for everything) keeps catching them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen.schemas import BatchObject


class BatchGenError(RuntimeError):
    """Base of every error this package raises."""


class APIError(BatchGenError):
    """A request to the server did not succeed."""

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id


class APIStatusError(APIError):
    """The server answered with a non-2xx status; fields come from its ``{"error": {...}}`` envelope."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message, request_id=request_id)
        self.status_code = status_code
        self.type = type
        self.code = code
        self.param = param

    def __str__(self) -> str:
        details = ", ".join(
            f"{name}={value}"
            for name, value in (("code", self.code), ("param", self.param), ("request_id", self.request_id))
            if value is not None
        )
        return f"{self.status_code}: {self.message}" + (f" ({details})" if details else "")


class BadRequestError(APIStatusError):
    """400 or 422: the request was malformed or failed validation."""


class AuthenticationError(APIStatusError):
    """401: missing or invalid API key."""


class PermissionDeniedError(APIStatusError):
    """403."""


class NotFoundError(APIStatusError):
    """404: no such file, batch or model."""


class ConflictError(APIStatusError):
    """409: the object is in a state that does not allow the operation (e.g. cancelling a finished batch)."""


class RequestTooLargeError(APIStatusError):
    """413: the upload exceeds the server's limits."""


class RateLimitError(APIStatusError):
    """429: the server is at capacity; retried automatically before this is raised."""


class InternalServerError(APIStatusError):
    """5xx; retried automatically before this is raised."""


class APIConnectionError(APIError):
    """The server could not be reached or the connection broke."""


class APITimeoutError(APIConnectionError):
    """The request timed out."""


class BatchOutcomeError(BatchGenError):
    """A batch ended in a state other than ``completed``; ``batch`` is its final object."""

    def __init__(self, batch: BatchObject) -> None:
        self.batch = batch
        super().__init__(self._describe(batch))

    @staticmethod
    def _describe(batch: BatchObject) -> str:
        reasons = [
            f"line {error.line}: {error.message}" if error.line is not None else str(error.message)
            for error in (batch.errors.data if batch.errors else [])
        ]
        return f"batch {batch.id} {batch.status}" + (": " + "; ".join(reasons) if reasons else "")


class BatchFailedError(BatchOutcomeError):
    """The batch failed (e.g. its input file did not validate); ``batch.errors`` says why."""


class BatchCancelledError(BatchOutcomeError):
    """The batch was cancelled."""


class BatchExpiredError(BatchOutcomeError):
    """The batch did not finish within its completion window."""


class BatchWaitTimeoutError(BatchGenError, TimeoutError):
    """``wait_for_batch`` gave up before the batch reached a terminal state (the batch keeps running)."""

    def __init__(self, batch: BatchObject, timeout_s: float) -> None:
        self.batch = batch
        super().__init__(f"batch {batch.id} did not finish within {timeout_s:g}s (status {batch.status})")


STATUS_ERRORS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: RequestTooLargeError,
    422: BadRequestError,
    429: RateLimitError,
}


def status_error_class(status_code: int) -> type[APIStatusError]:
    if status_code >= 500:
        return InternalServerError
    return STATUS_ERRORS.get(status_code, APIStatusError)


OUTCOME_ERRORS: dict[str, type[BatchOutcomeError]] = {
    "failed": BatchFailedError,
    "cancelled": BatchCancelledError,
    "expired": BatchExpiredError,
}
