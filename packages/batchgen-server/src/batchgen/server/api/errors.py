"""The error envelope: every non-2xx answer, Litestar's own included, is ``{"error": {message, type, param, code}}``,
and every response carries an ``x-request-id``."""

from __future__ import annotations

import logging
import re
import secrets
from typing import Any

from litestar import Request, Response
from litestar.datastructures import MutableScopeHeaders
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import ResponseSpec
from litestar.types import ExceptionHandlersMap, Message, Scope

from batchgen.schemas import ErrorDetail, ErrorResponse

from ..security.auth import UNAUTHORIZED_HEADERS, ApiKeyAuthMiddleware
from ..security.limits import LimitError
from ..storage.faults import out_of_descriptors, storage_fault

log = logging.getLogger("batchgen.server")

_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_CODES = {
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "rate_limit_exceeded",
}


ERROR_RESPONSES = {
    status: ResponseSpec(ErrorResponse, description=description, generate_examples=False)
    for status, description in (
        (400, "Invalid request: the error names the parameter"),
        (401, "Missing or invalid API key"),
        (404, "No such object (or it belongs to another key)"),
        (409, "Conflict with the object's state"),
        (413, "Upload over the size limit"),
        (422, "Invalid input file"),
        (408, "The upload went quiet and was dropped"),
        (429, "The queue is full; retry after Retry-After seconds"),
        (503, "The server is shutting down; retry shortly"),
        (507, "The server's storage is full or failing; nothing was stored, retry later"),
    )
}
"""The error envelope as the OpenAPI document publishes it, for every ``/v1`` operation (in place of Litestar's)."""


class APIError(Exception):
    """An error answered to the client as it is."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str | None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}


def not_found(kind: str, object_id: str, *, param: str | None = None) -> APIError:
    return APIError(404, f"No such {kind}: '{object_id}'", code=f"{kind}_not_found", param=param)


def invalid(message: str, *, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


def error_response(
    status_code: int, message: str, *, code: str | None, param: str | None = None, headers: dict[str, str] | None = None
) -> Response[ErrorResponse]:
    error_type = _TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")
    body = ErrorResponse(error=ErrorDetail(message=message, type=error_type, param=param, code=code))
    return Response(body, status_code=status_code, headers=headers)


def _api_error(_: Request[Any, Any, Any], exc: APIError) -> Response[ErrorResponse]:
    return error_response(exc.status_code, exc.message, code=exc.code, param=exc.param, headers=exc.headers)


def _limit_error(_: Request[Any, Any, Any], exc: LimitError) -> Response[ErrorResponse]:
    return error_response(exc.status_code, exc.message, code=exc.code, param=exc.param)


_MISSING = re.compile(r"missing required field `([^`]+)`")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")


def _validation_error(_: Request[Any, Any, Any], exc: ValidationException) -> Response[ErrorResponse]:
    """Litestar's parameter and body validation: name the offending parameter and say what is wrong with it."""
    detail = exc.extra[0] if isinstance(exc.extra, list) and exc.extra else {}
    message = str(detail.get("message") or exc.detail)
    # Litestar names the body "data" and msgspec marks dict values "[...]": keep only the field path.
    param = re.sub(r"^data(?:\.|(?=\[)|$)|\[\.\.\.\]", "", str(detail.get("key") or "")) or None
    code = "invalid_value"
    if match := _MISSING.search(message):
        code, param = "missing_required_parameter", _join(param, match.group(1))
    elif match := _UNKNOWN.search(message):
        code, param = "unknown_parameter", _join(param, match.group(1))
        return error_response(400, f"Unrecognized request argument supplied: '{param}'.", code=code, param=param)
    elif "missing required" in message.lower():
        code = "missing_required_parameter"
    elif detail.get("source") == "body" and param is None:
        code = "invalid_json"
    if param:
        message = f"Invalid parameter '{param}': {message}"
    return error_response(400, message, code=code, param=param)


def _join(parent: str | None, child: str) -> str:
    return child if not parent or parent == child else f"{parent}.{child}"


CLIENT_LEFT = "client disconnected prematurely"
"""Litestar's words (a 500) when the client goes away before its body is read: the client's doing, not an error."""


def _http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[ErrorResponse]:
    status_code, message = exc.status_code, exc.detail
    if message == CLIENT_LEFT:
        log.info("%s %s: the client left before sending its whole body", request.method, request.url.path)
        return error_response(499, "The client closed the request.", code="client_closed_request")
    if status_code >= 500:
        log.error("internal error: %s", exc.detail)
        return error_response(status_code, "The server had an error while processing the request.", code="server_error")
    code = _CODES.get(status_code, "invalid_request")
    if status_code in (404, 405):
        # No route, or not for this method: the middleware never saw the request, so ask it here. Without a key
        # the answer is 401 either way, and reveals nothing of which paths exist.
        auth: ApiKeyAuthMiddleware = request.app.state.auth
        if (unauthorized := auth.rejection(request.scope)) is not None:
            return Response(unauthorized, status_code=401, headers=UNAUTHORIZED_HEADERS)
    if status_code == 404:
        message = f"No route for {request.method} {request.url.path}; see /schema for the API."
    elif status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    elif status_code == 400 and "JSON is malformed" in message:
        code = "invalid_json"
    return error_response(status_code, message, code=code, headers=exc.headers)


def _too_deep(_: Request[Any, Any, Any], exc: RecursionError) -> Response[ErrorResponse]:
    """msgspec's decoder refuses JSON nested past Python's recursion limit with a RecursionError, raised while the
    body is decoded (anything shallower that nests deeply is refused by ``request_problem``)."""
    return error_response(400, "The JSON body is nested too deeply.", code="invalid_json")


def _unexpected_error(request: Request[Any, Any, Any], exc: Exception) -> Response[ErrorResponse]:
    reason = storage_fault(exc)
    if reason is not None:  # the request changed nothing, and can be retried
        log.warning("%s %s refused: storage fault (%s)", request.method, request.url.path, reason)
        if out_of_descriptors(exc):  # the disk is fine: descriptors come back as other requests finish
            message = f"The server is out of resources for the moment ({reason}); nothing was stored. Retry shortly."
            return error_response(503, message, code="resources_exhausted", headers={"Retry-After": "1"})
        message = f"The server's storage cannot take this now ({reason}); nothing was stored. Retry later."
        return error_response(507, message, code="insufficient_storage")
    log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "The server had an error while processing the request.", code="server_error")


EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    APIError: _api_error,
    LimitError: _limit_error,
    ValidationException: _validation_error,
    HTTPException: _http_error,
    RecursionError: _too_deep,
    Exception: _unexpected_error,
}


async def add_request_id(message: Message, scope: Scope) -> None:
    """``before_send`` hook: tag every response, routed or not, with an ``x-request-id`` (the client's, if sane)."""
    if message["type"] != "http.response.start":
        return
    headers = MutableScopeHeaders.from_message(message)
    incoming = dict(scope.get("headers", ())).get(b"x-request-id", b"").decode("latin-1")
    request_id = incoming if re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", incoming) else f"req_{secrets.token_hex(16)}"
    headers["x-request-id"] = request_id
