"""The sans-I/O core both clients share: request building, response parsing, error mapping and the retry policy.

``BatchGenHttpClient`` and ``AsyncBatchGenHttpClient`` only send what this module builds, sleep for as long as it
says, and hand it the responses; every decision lives here once.
"""

from __future__ import annotations

import email.utils
import importlib.metadata
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, BinaryIO, Generic, TypeVar

import httpx
import msgspec

from batchgen.schemas import (
    BatchList,
    BatchObject,
    BatchOutputLine,
    ErrorResponse,
    FileDeleted,
    FileList,
    FileObject,
    GenerationDefaults,
    HealthStatus,
    JsonSchemaFormat,
    Metadata,
    ModelList,
    ModelObject,
    PoolStatus,
    ResponseFormat,
    parse_output_line,
)

from .errors import APIConnectionError, APIError, APIStatusError, APITimeoutError, status_error_class

T = TypeVar("T")

DEFAULT_BASE_URL = "http://localhost:10900"
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MAX_RETRIES = 2
VERSION = importlib.metadata.version("batchgen-client")
USER_AGENT = f"batchgen-client/{VERSION}"

FileInput = str | os.PathLike[str] | bytes | BinaryIO
"""What ``upload_file`` accepts: a path, the content itself, or a binary file object (streamed, never read whole)."""
RequestsInput = FileInput | Sequence[Mapping[str, Any]]
"""What ``submit_batch`` accepts: a file input as above, or a list of input lines or request bodies."""
Sleep = Callable[[float], None]
AsyncSleep = Callable[[float], Awaitable[None]]
"""How a client waits between retries and polls (tests pass a recorder); ``_sync.py`` gets ``Sleep``."""


@dataclass(frozen=True)
class Upload:
    """The ``file`` part of a multipart upload; a path is opened afresh for every attempt."""

    source: FileInput
    filename: str
    purpose: str

    @property
    def replayable(self) -> bool:
        """Whether a retry can send the same bytes again (httpx rewinds seekable file objects itself)."""
        return not hasattr(self.source, "read") or bool(getattr(self.source, "seekable", lambda: False)())

    @contextmanager
    def opened(self) -> Iterator[dict[str, Any]]:
        if isinstance(self.source, str | os.PathLike):
            with open(self.source, "rb") as stream:
                yield self._form(stream)
        else:
            yield self._form(self.source)

    def _form(self, content: bytes | IO[bytes]) -> dict[str, Any]:
        return {"files": {"file": (self.filename, content, "application/jsonl")}, "data": {"purpose": self.purpose}}


@dataclass(frozen=True)
class ApiRequest(Generic[T]):
    """One API call: what to send, and how to turn the final response into ``T``."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    params: Mapping[str, str | int] = field(default_factory=dict)
    json: bytes | None = None
    upload: Upload | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    stream: bool = False
    """Leave the body unread so the caller can stream it (downloads)."""
    retry: bool = True
    accept: frozenset[int] = frozenset()
    """Non-2xx statuses that ``parse`` handles itself instead of raising."""


ResponseFormatInput = ResponseFormat | Mapping[str, Any] | type
"""A ``response_format``: the wire type, its JSON as a dict, or a pydantic model class (its JSON schema)."""


def as_response_format(value: ResponseFormatInput | None) -> ResponseFormat | None:
    """``value`` as the wire type; a pydantic model class becomes a strict ``json_schema`` format, named after it, as
    the ``openai`` SDK's ``.parse()`` sends it (duck-typed: the client does not depend on pydantic)."""
    if value is None or isinstance(value, ResponseFormat):
        return value
    if isinstance(value, type):
        schema = getattr(value, "model_json_schema", None)
        if schema is None:
            raise TypeError(f"response_format: {value.__name__} is not a pydantic model class")
        return ResponseFormat(
            type="json_schema", json_schema=JsonSchemaFormat(name=value.__name__, schema_=schema(), strict=True)
        )
    return msgspec.convert(value, ResponseFormat)


def _decoder(kind: type[T]) -> Callable[[httpx.Response], T]:
    decoder = msgspec.json.Decoder(kind)

    def parse(response: httpx.Response) -> T:
        try:
            return decoder.decode(response.content)
        except msgspec.DecodeError as exc:
            raise APIError(
                f"unexpected response to {response.request.method} {response.request.url.path}: {exc}",
                request_id=response.headers.get("x-request-id"),
            ) from exc

    return parse


def _raw(response: httpx.Response) -> httpx.Response:
    return response


_parse_file = _decoder(FileObject)
_parse_batch = _decoder(BatchObject)
_parse_health = _decoder(HealthStatus)


def _health(response: httpx.Response) -> HealthStatus:
    """``/health`` answers 503 when unhealthy; that is a result, not an error."""
    if response.is_success:
        return _parse_health(response)
    try:
        return msgspec.json.decode(response.content, type=HealthStatus)
    except msgspec.DecodeError:
        return HealthStatus(status="unhealthy", reason=error_from_response(response).message)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for connection errors, 408, 429 and 5xx, honouring ``Retry-After``."""

    max_retries: int = DEFAULT_MAX_RETRIES
    initial_delay_s: float = 0.5
    max_delay_s: float = 8.0
    max_retry_after_s: float = 60.0
    random: Callable[[], float] = random.random

    @staticmethod
    def retryable_status(status_code: int) -> bool:
        return status_code in (408, 429) or status_code >= 500

    def delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        """Seconds to wait before retry number ``attempt + 1``."""
        if response is not None:
            retry_after = self._retry_after(response)
            if retry_after is not None and 0 <= retry_after <= self.max_retry_after_s:
                return retry_after
        backoff = min(self.initial_delay_s * 2.0**attempt, self.max_delay_s)
        return backoff * (1.0 - 0.25 * self.random())

    @staticmethod
    def _retry_after(response: httpx.Response) -> float | None:
        if (milliseconds := response.headers.get("retry-after-ms")) is not None:
            try:
                return float(milliseconds) / 1000.0
            except ValueError:
                pass
        value = response.headers.get("retry-after")
        if value is None:
            return None
        try:
            return float(value)
        except ValueError:
            pass
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        return when.timestamp() - time.time()


def error_from_response(response: httpx.Response) -> APIStatusError:
    """Map a non-2xx response to its typed error, with the fields of the ``{"error": {...}}`` envelope."""
    request_id = response.headers.get("x-request-id")
    try:
        detail = msgspec.json.decode(response.content, type=ErrorResponse).error
    except msgspec.DecodeError:
        message = response.text.strip() or response.reason_phrase or "request failed"
        return status_error_class(response.status_code)(
            message, status_code=response.status_code, request_id=request_id
        )
    return status_error_class(response.status_code)(
        detail.message,
        status_code=response.status_code,
        type=detail.type,
        code=detail.code,
        param=detail.param,
        request_id=request_id,
    )


def connection_error(exc: httpx.TransportError) -> APIConnectionError:
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"request timed out: {exc!r}")
    return APIConnectionError(f"could not reach the server: {exc!r}")


class ClientCore:
    """Configuration plus one builder per endpoint; holds no connection."""

    def __init__(
        self,
        base_url: str | None,
        api_key: str | None,
        timeout_s: float | None,
        max_retries: int,
    ) -> None:
        url = (base_url or os.environ.get("BATCHGEN_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        # Accept an OpenAI-style base URL ending in /v1: every path below carries its own prefix.
        self.base_url = url.removesuffix("/v1")
        self.api_key = api_key if api_key is not None else os.environ.get("BATCHGEN_API_KEY")
        self.timeout = httpx.Timeout(timeout_s)
        self.retry = RetryPolicy(max_retries=max_retries)

    # -- sending --------------------------------------------------------------------------------------------------

    @contextmanager
    def build(self, request: ApiRequest[Any]) -> Iterator[dict[str, Any]]:
        """Keyword arguments for ``httpx.Client.build_request``; open for as long as the request is being sent."""
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT, **request.headers}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        kwargs: dict[str, Any] = {
            "method": request.method,
            "url": self.base_url + request.path,
            "params": dict(request.params),
            "headers": headers,
            "timeout": self.timeout,
        }
        if request.json is not None:
            headers["Content-Type"] = "application/json"
            kwargs["content"] = request.json
        if request.upload is None:
            yield kwargs
        else:
            with request.upload.opened() as form:
                yield {**kwargs, **form}

    def retry_delay(self, request: ApiRequest[Any], attempt: int, response: httpx.Response | None) -> float | None:
        """How long to wait before retrying, or ``None`` to stop; ``response`` is ``None`` after a connection error."""
        if not request.retry or attempt >= self.retry.max_retries:
            return None
        if response is not None and not self.retry.retryable_status(response.status_code):
            return None
        return self.retry.delay(attempt, response)

    def finish(self, request: ApiRequest[T], response: httpx.Response) -> T:
        """Parse the final response (its body already read unless streaming and successful), or raise its error."""
        if response.is_success or response.status_code in request.accept:
            return request.parse(response)
        raise error_from_response(response)

    # -- endpoints ------------------------------------------------------------------------------------------------

    def health_check(self) -> ApiRequest[HealthStatus]:
        return ApiRequest("GET", "/health", _health, retry=False, accept=frozenset({503}))

    def list_models(self) -> ApiRequest[ModelList]:
        return ApiRequest("GET", "/v1/models", _decoder(ModelList))

    def get_model(self, model_id: str) -> ApiRequest[ModelObject]:
        return ApiRequest("GET", f"/v1/models/{model_id}", _decoder(ModelObject))

    def upload_file(self, file: FileInput, purpose: str, filename: str | None) -> ApiRequest[FileObject]:
        upload = Upload(file, filename or _filename(file), purpose)
        return ApiRequest(
            "POST", "/v1/files", _parse_file, upload=upload, headers=_idempotency(), retry=upload.replayable
        )

    def get_file(self, file_id: str) -> ApiRequest[FileObject]:
        return ApiRequest("GET", f"/v1/files/{file_id}", _parse_file)

    def list_files(self, purpose: str | None, order: str, page_size: int) -> ApiRequest[FileList]:
        params: dict[str, str | int] = {"order": order, "limit": page_size}
        if purpose is not None:
            params["purpose"] = purpose
        return ApiRequest("GET", "/v1/files", _decoder(FileList), params=params)

    def delete_file(self, file_id: str) -> ApiRequest[FileDeleted]:
        return ApiRequest("DELETE", f"/v1/files/{file_id}", _decoder(FileDeleted))

    def file_content(self, file_id: str, *, stream: bool) -> ApiRequest[httpx.Response]:
        return ApiRequest("GET", f"/v1/files/{file_id}/content", _raw, headers={"Accept": "*/*"}, stream=stream)

    def create_batch(
        self,
        input_file_id: str,
        *,
        endpoint: str,
        completion_window: str,
        metadata: Metadata | None,
        defaults: GenerationDefaults,
        output_expires_after_s: int | None = None,
    ) -> ApiRequest[BatchObject]:
        """Unset (``None``) metadata and defaults are left out of the body."""
        expiry = {"anchor": "created_at", "seconds": output_expires_after_s}
        body = {
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": completion_window,
            **({"metadata": metadata} if metadata is not None else {}),
            **({"output_expires_after": expiry} if output_expires_after_s is not None else {}),
            **msgspec.to_builtins(defaults),
        }
        return ApiRequest("POST", "/v1/batches", _parse_batch, json=msgspec.json.encode(body), headers=_idempotency())

    def get_batch(self, batch_id: str) -> ApiRequest[BatchObject]:
        return ApiRequest("GET", f"/v1/batches/{batch_id}", _parse_batch)

    def list_batches(self, page_size: int) -> ApiRequest[BatchList]:
        return ApiRequest("GET", "/v1/batches", _decoder(BatchList), params={"limit": page_size})

    def cancel_batch(self, batch_id: str) -> ApiRequest[BatchObject]:
        return ApiRequest("POST", f"/v1/batches/{batch_id}/cancel", _parse_batch)

    def pool_status(self) -> ApiRequest[PoolStatus]:
        return ApiRequest("GET", "/v1/pool/status", _decoder(PoolStatus))


PageT = TypeVar("PageT", FileList, BatchList)


def next_page(request: ApiRequest[PageT], page: PageT) -> ApiRequest[PageT] | None:
    """The request for the page after ``page``, following the ``after`` cursor, or ``None`` after the last one."""
    if not page.has_more or not page.data:
        return None
    return replace(request, params={**request.params, "after": page.last_id or page.data[-1].id})


def _idempotency() -> dict[str, str]:
    """A fresh key per logical create, sent unchanged on every retry so the server creates at most one object."""
    return {"Idempotency-Key": f"batchgen-{uuid.uuid4()}"}


def _filename(file: FileInput) -> str:
    if isinstance(file, str | os.PathLike):
        return Path(file).name
    name = getattr(file, "name", None)
    return Path(name).name if isinstance(name, str) else "input.jsonl"


def requests_jsonl(requests: Sequence[Mapping[str, Any]], endpoint: str) -> bytes:
    """Encode input lines as JSONL; a bare request body (no ``body`` key) is wrapped into a line for ``endpoint``."""
    lines = (
        request
        if "body" in request
        else {"custom_id": f"request-{index}", "method": "POST", "url": endpoint, "body": request}
        for index, request in enumerate(requests)
    )
    return b"".join(msgspec.json.encode(line) + b"\n" for line in lines)


def batch_input(requests: RequestsInput, endpoint: str) -> FileInput:
    if isinstance(requests, Sequence) and not isinstance(requests, str | bytes):
        return requests_jsonl(requests, endpoint)
    return requests


class _CustomId(msgspec.Struct):
    custom_id: str


_CUSTOM_ID = msgspec.json.Decoder(_CustomId)


def parse_results(contents: Iterable[bytes], input_content: bytes | None) -> Iterator[BatchOutputLine]:
    """Typed lines of a batch's output and error files; in the input file's order when its content is given."""
    lines = (parse_output_line(line) for content in contents for line in content.splitlines() if line.strip())
    if input_content is None:
        yield from lines
        return
    position = {
        _CUSTOM_ID.decode(line).custom_id: index
        for index, line in enumerate(input_content.splitlines())
        if line.strip()
    }
    yield from sorted(lines, key=lambda line: position.get(line.custom_id, len(position)))


@contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """Write to a temporary sibling and rename it over ``path`` only once complete."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.partial")
    try:
        with open(partial, "wb") as stream:
            yield stream
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
