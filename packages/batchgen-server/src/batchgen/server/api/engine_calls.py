"""Online requests inside the engine: admitted while they fit the capacity, their results reaching the event loop
as they come, aborted when their caller leaves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..engine import EngineRequest, EngineResult, EngineWorker
from .errors import APIError

RETRY_AFTER_S = 1
"""An online request's place frees as soon as another finishes (seconds), unlike a batch's queue."""
ENGINE_CHECK_S = 1.0
"""How often a request waiting on the engine checks that it still runs."""


@dataclass(slots=True)
class OnlineRequests:
    """The online requests inside the engine: admitted while their sequences fit ``capacity``."""

    worker: EngineWorker
    capacity: int
    sequences: int = 0
    """Sequences (prompts x n) of the online requests inside the engine now."""

    def check(self, sequences: int) -> None:
        """429 when ``sequences`` more would not fit now; 400 when they never would; 503 when the engine is dead."""
        if self.worker.state == "dead":
            raise engine_stopped(self.worker)
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

    @contextlib.asynccontextmanager
    async def run(self, requests: list[EngineRequest]) -> AsyncIterator[EngineCall]:
        """Submit ``requests``; on leaving, abort whatever has not finished and give their place back."""
        sequences = sum(request.params.n for request in requests)
        self.sequences += sequences
        call = EngineCall(self.worker, requests)
        try:
            yield call
        finally:
            call.abort_unfinished()
            self.sequences -= sequences


@dataclass(eq=False)
class EngineCall:
    """One request's engine requests inside the worker; their results reach the event loop as they come."""

    worker: EngineWorker
    requests: list[EngineRequest]
    _unfinished: dict[str, int] = field(init=False)
    """Engine request id -> its prompt's index, until its final result."""
    _results: asyncio.Queue[EngineResult] = field(init=False, default_factory=asyncio.Queue)

    def __post_init__(self) -> None:
        self._unfinished = {request.request_id: index for index, request in enumerate(self.requests)}
        loop = asyncio.get_running_loop()
        self.worker.submit(self.requests, lambda result: loop.call_soon_threadsafe(self._results.put_nowait, result))

    async def results(self) -> AsyncIterator[tuple[int, EngineResult]]:
        """Each result, partial or final, with its prompt's index, until every request has its final one."""
        while self._unfinished:
            result = await self._next()
            index = self._unfinished[result.request_id]
            if result.finished:
                del self._unfinished[result.request_id]
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
            self.worker.abort(list(self._unfinished))

    async def _next(self) -> EngineResult:
        while True:
            try:
                return await asyncio.wait_for(self._results.get(), ENGINE_CHECK_S)
            except TimeoutError:
                if self.worker.state == "dead":
                    raise engine_stopped(self.worker) from None


def engine_stopped(worker: EngineWorker) -> APIError:
    """The answer to an online request once the engine has stopped for good (``/health`` says why too)."""
    return APIError(
        503,
        f"The engine stopped ({worker.error!r}); the server must be restarted. Retry shortly.",
        code="engine_stopped",
        headers={"Retry-After": "5"},
    )
