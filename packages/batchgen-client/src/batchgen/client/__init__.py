"""batchgen client: sync and async HTTP clients of the batchgen batch inference API, and the `batchgen` CLI."""

from ._async import AsyncBatchGenHttpClient
from ._core import FileInput, RequestsInput
from ._sync import BatchGenHttpClient
from .errors import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    BatchCancelledError,
    BatchExpiredError,
    BatchFailedError,
    BatchGenError,
    BatchOutcomeError,
    BatchWaitTimeoutError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
)

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncBatchGenHttpClient",
    "AuthenticationError",
    "BadRequestError",
    "BatchCancelledError",
    "BatchExpiredError",
    "BatchFailedError",
    "BatchGenError",
    "BatchGenHttpClient",
    "BatchOutcomeError",
    "BatchWaitTimeoutError",
    "ConflictError",
    "FileInput",
    "InternalServerError",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestTooLargeError",
    "RequestsInput",
]
