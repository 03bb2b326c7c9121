"""Online endpoints: ``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings``, answered by the engine
that runs the batches, ahead of them.

A request is validated as a batch line is (its types, ``request_problem``, then ``OpenAIServing``), runs as
interactive engine requests (scheduled before batch work, preempting it for room), and is answered whole or, with
``stream: true``, as server-sent events while it generates. A client that goes away aborts its requests. Online
requests hold at most ``--max-online-sequences`` sequences inside the engine; more are answered 429.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import Future
from functools import partial
from typing import Any

from litestar import Controller, Request, post
from litestar.response import Stream

from batchgen.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingList,
    EmbeddingRequest,
    RequestBody,
    ResponseRequest,
    TextCompletion,
)
from batchgen.schemas.validation import request_problem

from ..engine import EngineResult
from ..ids import new_request_id
from ..media.fetcher import Fetched
from ..media.files import files_of
from ..security.auth import DEFAULT_TENANT
from ..serving import BatchDefaults, PreparedRequest, RequestRejected, failed
from ..serving.answers import ResponseBody
from ..serving.response_stream import ResponseStream
from ..serving.streaming import StreamedResponse
from .deps import ServerContext
from .engine_calls import RETRY_AFTER_S, EngineCall, StreamBacklog
from .errors import ERROR_RESPONSES, APIError

NO_DEFAULTS = BatchDefaults()


class OnlineController(Controller):
    tags = ("online",)

    @post(
        "/v1/chat/completions",
        status_code=200,
        summary="Create a chat completion now (stream: true for server-sent events)",
        responses=ERROR_RESPONSES,
    )
    async def chat(
        self, data: ChatCompletionRequest, request: Request[Any, Any, Any], context: ServerContext
    ) -> ChatCompletion | Stream:
        response = await serve(context, request, data)
        assert isinstance(response, ChatCompletion | Stream)
        return response

    @post(
        "/v1/completions",
        status_code=200,
        summary="Create a completion now (stream: true for server-sent events)",
        responses=ERROR_RESPONSES,
    )
    async def completions(
        self, data: CompletionRequest, request: Request[Any, Any, Any], context: ServerContext
    ) -> TextCompletion | Stream:
        response = await serve(context, request, data)
        assert isinstance(response, TextCompletion | Stream)
        return response

    @post("/v1/embeddings", status_code=200, summary="Create embeddings now", responses=ERROR_RESPONSES)
    async def embeddings(
        self, data: EmbeddingRequest, request: Request[Any, Any, Any], context: ServerContext
    ) -> EmbeddingList:
        response = await serve(context, request, data)
        assert isinstance(response, EmbeddingList)
        return response


async def prepare(
    context: ServerContext, body: RequestBody, request_id: str, *, online: bool, owner: str = DEFAULT_TENANT
) -> PreparedRequest:
    """``body`` checked as a batch line is checked, and made ready to run; an ``APIError`` names what is wrong."""
    if (problem := request_problem(body)) is not None:
        name, detail = problem
        raise APIError(400, f"Invalid '{name}': {detail}", code="invalid_request", param=name)
    serving = context.serving
    try:
        pending = serving.fetch_images(body, owner)  # on the fetcher's loop: a slow host holds no thread
        fetched: Fetched | None = None
        if pending is not None:
            images = "input" if isinstance(body, ResponseRequest) else "messages"
            fetched = await _within_deadline(pending, serving.preparer.images.limits.fetch_timeout_s, images)
        work = partial(
            serving.prepare, body, request_id=request_id, defaults=NO_DEFAULTS, online=online, fetched=fetched
        )
        with files_of(owner):  # the images its parts name by file id: the caller's own (copied into the thread)
            return await context.preparations.run(owner, work)  # a long prompt takes a while: not on the event loop
    except RequestRejected as exc:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status_code == 429 else None
        raise APIError(exc.status_code, exc.message, code=exc.code, param=exc.param, headers=headers) from None


async def _within_deadline(pending: Future[Fetched], timeout_s: float, param: str) -> Fetched:
    """The pictures fetched, their turn behind the caller's other fetches within the fetch deadline too (a second
    more: a fetch that started at once runs out first, and says which picture it was)."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(pending), timeout_s + 1)
    except TimeoutError:  # the fetches are cancelled with it
        message = f"Fetching the request's images took over {timeout_s:g} s."
        raise RequestRejected("image_fetch_failed", message, param) from None


async def serve(context: ServerContext, request: Request[Any, Any, Any], body: RequestBody) -> ResponseBody | Stream:
    """Answer ``body`` now: whole, or as server-sent events with ``stream: true``."""
    request_id = new_request_id()
    prepared = await prepare(context, body, request_id, online=True, owner=request.user)
    call = context.online.start(prepared.requests)  # a stream's place too is taken now, before its first byte
    if isinstance(body, ChatCompletionRequest | CompletionRequest | ResponseRequest) and body.stream:
        stream: StreamedResponse | ResponseStream
        if isinstance(body, ResponseRequest):
            stream = ResponseStream(prepared, context.serving.logprobs)
        else:
            stream = StreamedResponse(prepared, context.serving.logprobs)
        events = _events(stream, call)
        # The content type as a header: Litestar would give a Stream the route's JSON media type.
        return Stream(events, headers={"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"})
    async with call:
        results = await _unless_disconnected(request, call.final_results())
    if (failure := failed(results)) is not None:
        status, error = failure
        raise APIError(status, error.message, code=error.code)
    return context.serving.response_body(prepared, results)


async def _events(stream: StreamedResponse | ResponseStream, call: EngineCall) -> AsyncIterator[bytes]:
    """The events of a streamed request. A client that goes away cancels this (Litestar listens for it), which
    aborts the request in the engine."""
    try:
        async with call:
            for event in stream.start():
                yield event
            async for index, result in call.results():
                if (failure := failed([result])) is not None:
                    status, error = failure
                    for event in stream.error(error.code, error.message, status):
                        yield event
                    return
                for event in stream.add(index, result):
                    yield event
    except APIError as error:  # the engine stopped: the status is sent already
        for event in stream.error(error.code or "server_error", error.message, error.status_code):
            yield event
        return
    except StreamBacklog as backlog:
        for event in stream.error("stream_backlog", str(backlog), 400):
            yield event
        return
    for event in stream.end():
        yield event


async def _unless_disconnected(request: Request[Any, Any, Any], work: Any) -> list[EngineResult]:
    """``work``'s result; if the client goes away first, ``work`` is cancelled (and the caller leaving its
    call aborts the requests)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # nothing, once it is done
    if not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise APIError(499, "The client closed the request.", code="client_closed_request")
    result: list[EngineResult] = task.result()
    return result


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    """Returns when the client has gone (the body has been read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
