"""Online requests inside the engine: admitted while they fit the capacity, their results reaching the event loop
as they come, aborted when their caller leaves.

A streamed request's partial results are merged while its reader has not taken them (one pending result per prompt,
not one per engine step), so a client that reads slowly costs the tokens it has not read, not a queue of every
step; past ``max_backlog_tokens`` unread tokens its requests are aborted and its stream ends with an error.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ..engine.interface import EngineClient
from ..engine.request import CompletionOutput, EngineRequest, EngineResult
from .errors import APIError

RETRY_AFTER_S = 1
"""An online request's place frees as soon as another finishes (seconds), unlike a batch's queue."""
ENGINE_CHECK_S = 1.0
"""How often a request waiting on the engine checks that it still runs."""


@dataclass(slots=True)
class OnlineRequests:
    """The online requests inside the engine: admitted while their sequences fit ``capacity``."""

    engine: EngineClient
    capacity: int
    max_backlog_tokens: int
    """Most generated tokens a stream's reader may leave unread before the request is stopped."""
    sequences: int = 0
    """Sequences (prompts x n) of the online requests inside the engine now."""

    def start(self, requests: list[EngineRequest]) -> EngineCall:
        """Admit ``requests`` and submit them, their place held from now until each has left the engine (a stream's
        reader may still be reading): 429 when they would not fit now, 400 when they never would, 503 when the engine
        is dead. The caller runs the call (``async with``), which aborts whatever has not finished when it ends; a
        call never run (a stream whose client left before it began) runs to its end and gives its place back."""
        sequences = sum(request.params.n for request in requests)
        self._check(sequences)
        self.sequences += sequences  # checked and taken in one go on the event loop: no other admission between
        try:
            return EngineCall(self.engine, requests, self.max_backlog_tokens, on_left=self._left)
        except BaseException:
            self.sequences -= sequences
            raise

    def _check(self, sequences: int) -> None:
        if self.engine.state == "dead":
            raise engine_stopped(self.engine)
        if sequences > self.capacity:
            raise APIError(
                400,
                f"The request asks for {sequences} sequences (prompts x n); online requests may hold at most "
                f"{self.capacity} (--max-online-sequences). Split it, or submit it as a batch.",
                code="too_many_sequences",
            )
        if self.sequences + sequences > self.capacity:
            raise APIError(
                429,
                f"The server is busy: online requests hold {self.sequences} sequences of its {self.capacity}; "
                f"retry after {RETRY_AFTER_S} s.",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def _left(self, request: EngineRequest) -> None:
        self.sequences -= request.params.n


@dataclass(eq=False)
class EngineCall:
    """One request's engine requests inside the engine; their results reach the event loop as they come."""

    engine: EngineClient
    requests: list[EngineRequest]
    max_backlog_tokens: int
    on_left: Callable[[EngineRequest], None]
    """Called once per engine request, when it has left the engine (finished or aborted)."""
    _unfinished: dict[str, int] = field(init=False)
    """Engine request id -> its prompt's index, until its final result."""
    _pending: dict[int, EngineResult] = field(init=False, default_factory=dict)
    """Results not taken yet, by prompt index: a streamed request's partial ones merged into one."""
    _backlog: int = field(init=False, default=0)
    """Generated tokens in ``_pending``."""
    _overflow: bool = field(init=False, default=False)
    _arrived: asyncio.Event = field(init=False, default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._unfinished = {request.request_id: index for index, request in enumerate(self.requests)}
        loop = asyncio.get_running_loop()

        def deliver(result: EngineResult) -> None:  # from the engine's thread
            loop.call_soon_threadsafe(self._arrive, result)

        self.engine.submit(self.requests, deliver)

    async def __aenter__(self) -> EngineCall:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort_unfinished()

    async def results(self) -> AsyncIterator[tuple[int, EngineResult]]:
        """Each prompt's result, partial or final, with its prompt's index, until every request has its final one;
        the partial results that came while the caller was busy arrive merged. ``StreamBacklog`` once the caller
        has left more than ``max_backlog_tokens`` unread."""
        while self._pending or self._unfinished:
            if not self._pending:
                await self._wait()
            if self._overflow:
                raise StreamBacklog(self.max_backlog_tokens)
            pending, self._pending, self._backlog = self._pending, {}, 0
            for index, result in pending.items():
                yield index, result

    async def final_results(self) -> list[EngineResult]:
        """Every request's final result, in prompt order."""
        finals: dict[int, EngineResult] = {}
        async for index, result in self.results():
            if result.finished:
                finals[index] = result
        return [finals[index] for index in range(len(self.requests))]

    def abort_unfinished(self) -> None:
        if self._unfinished:
            self.engine.abort(list(self._unfinished))
            for request_id in list(self._unfinished):
                self._leave(request_id)

    def _arrive(self, result: EngineResult) -> None:
        index = self._unfinished.get(result.request_id)
        if index is None:
            return  # aborted meanwhile
        if result.finished:
            self._leave(result.request_id)
        earlier = self._pending.get(index)
        self._pending[index] = result if earlier is None else _merged(earlier, result)
        self._backlog += result.completion_tokens if not result.finished else 0
        self._arrived.set()
        if self._backlog > self.max_backlog_tokens and not self._overflow:
            self._overflow = True
            self.abort_unfinished()

    def _leave(self, request_id: str) -> None:
        index = self._unfinished.pop(request_id)
        self.on_left(self.requests[index])

    async def _wait(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._arrived.wait(), ENGINE_CHECK_S)
            except TimeoutError:
                if self.engine.state == "dead":
                    raise engine_stopped(self.engine) from None
                continue
            self._arrived.clear()
            return


def _merged(earlier: EngineResult, later: EngineResult) -> EngineResult:
    """Two results of one request as one: a final result holds everything already; partial ones hold what is new
    for the choices that moved, so their outputs are joined choice by choice."""
    if later.finished:
        return later
    outputs = {output.index: output for output in earlier.outputs}
    for output in later.outputs:
        before = outputs.get(output.index)
        if before is None:
            outputs[output.index] = output
            continue
        logprobs = None if before.logprobs is None else before.logprobs + (output.logprobs or [])
        outputs[output.index] = CompletionOutput(
            output.index, before.token_ids + output.token_ids, before.text + output.text, output.finish_reason, logprobs
        )
    return dataclasses.replace(later, outputs=list(outputs.values()))


class StreamBacklog(Exception):
    """A stream's reader left more generated tokens unread than the server keeps for it."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"The client read the stream too slowly: more than {limit} generated tokens waited unread "
            "(--max-stream-backlog-tokens), so the request was stopped."
        )


def engine_stopped(engine: EngineClient) -> APIError:
    """The answer to an online request once the engine has stopped for good (``/health`` says why too)."""
    return APIError(
        503,
        f"The engine stopped ({engine.error!r}); the server must be restarted. Retry shortly.",
        code="engine_stopped",
        headers={"Retry-After": "5"},
    )
