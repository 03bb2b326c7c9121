"""Batch objects (``/v1/batches``), with the batchgen batch-level generation defaults."""

from __future__ import annotations

import typing
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ._base import Body, Wire
from .requests import ResponseFormat

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
STATUSES: tuple[BatchStatus, ...] = typing.get_args(BatchStatus)
TERMINAL_STATUSES: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
ACTIVE_STATUSES: tuple[str, ...] = tuple(status for status in STATUSES if status not in TERMINAL_STATUSES)
"""Unfinished: the server's batch loop owns the batch, and picks it up again after a restart."""

BatchEndpoint = Literal[
    "/v1/responses",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
    "/v2/rerank",
    "/rerank",
    "/score",
    "/classify",
    "/pooling",
]
ENDPOINTS: tuple[str, ...] = typing.get_args(BatchEndpoint)

Metadata = dict[str, str]


class BatchError(Wire, kw_only=True):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(Wire, kw_only=True):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchRequestCounts(Wire, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class InputTokensDetails(Wire, kw_only=True):
    cached_tokens: int = 0


class OutputTokensDetails(Wire, kw_only=True):
    reasoning_tokens: int = 0


class BatchUsage(Wire, kw_only=True):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class GenerationDefaults(Body, kw_only=True):
    """Batch-level generation defaults, batchgen's extension of ``POST /v1/batches`` (echoed on the batch object).

    Each applies to the requests of the batch that set no value of their own (a request's value always wins); ``None``
    sets no default. The one definition of these fields: the batch types inherit them, the server fills requests from
    them, the client sends them and the CLI derives its options (help text included) from them.
    """

    max_decoding_length: Annotated[int, Meta(ge=1, description="max output tokens of a request")] | None = None
    max_context_length: Annotated[int, Meta(ge=1, description="max prompt + output tokens of a request")] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2, description="sampling temperature (0: greedy)")] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1, description="nucleus sampling's probability mass")] | None = None
    top_k: Annotated[int, Meta(ge=-1, description="sample among the k likeliest tokens (0 or -1: all)")] | None = None
    response_format: (
        Annotated[ResponseFormat, Meta(description="the output format, as a request's response_format (JSON)")] | None
    ) = None


# Multiple inheritance keeps the wire format flat; msgspec puts the inherited fields first.
class BatchObject(Wire, GenerationDefaults, kw_only=True, omit_defaults=False):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = msgspec.field(default_factory=BatchRequestCounts)
    usage: BatchUsage = msgspec.field(default_factory=BatchUsage)
    metadata: Metadata | None = None


class BatchList(Wire, kw_only=True):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600
"""What a file's expiry may be, after its anchor: an hour to 30 days, as at OpenAI."""


class ExpiresAfter(Wire, kw_only=True, forbid_unknown_fields=True):
    """Files expire ``seconds`` after their ``created_at`` (the only anchor), and are then deleted."""

    anchor: Literal["created_at"]
    seconds: Annotated[int, Meta(ge=MIN_EXPIRY_S, le=MAX_EXPIRY_S)]


class CreateBatchRequest(GenerationDefaults, kw_only=True, forbid_unknown_fields=True, omit_defaults=False):
    """Body of ``POST /v1/batches``. Unknown fields are rejected so that typos do not pass silently; every field
    is sent (OpenAI requires ``endpoint`` and ``completion_window``)."""

    input_file_id: str
    endpoint: str = "/v1/chat/completions"
    completion_window: str = "24h"
    metadata: Metadata | None = None
    output_expires_after: ExpiresAfter | None = None
    """When the batch's output and error files expire (they live until deleted without it)."""
