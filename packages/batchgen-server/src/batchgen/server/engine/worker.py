"""EngineWorker: runs the engine's steps in a background thread for a server that must not block."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .interface import ClientState, EngineStats, ResultCallback, SteppingEngine
from .request import EngineError, EngineRequest, EngineResult, Task, failed_result
from .strikes import Strikes, cut_stream

if TYPE_CHECKING:
    from .config import EngineConfig

logger = logging.getLogger(__name__)

MAX_RESTARTS = 5
"""More engine failures than this within ``RESTART_WINDOW_S`` mean the device itself is broken: the worker stops."""
RESTART_WINDOW_S = 60.0
IDLE_CHECK_S = 1.0
"""How often an idle worker asks its engine whether something it runs on failed meanwhile (a tensor-parallel rank)."""


class EngineWorker:
    """The ``EngineClient`` of one ``SteppingEngine``: submissions and aborts are queued and applied between steps.

    A request's callback is invoked from the worker thread with its result, and before that with each partial result
    of a streamed request (``EngineResult.finished`` false). When idle the thread sleeps on a condition variable (no
    busy loop).

    The engine already fails a request whose step raises without stopping (``LLMEngine.step``). Should a step still
    fail (a fault it could not pin on a request), the worker restarts the engine in place: it empties the engine and
    submits again every request it held, so nothing accepted is lost. Each request of the failed step gets a strike
    (``strikes``: struck requests run on probation one at a time, beside the others; one with two strikes is
    quarantined, failed with a ``server_error`` result), so one request can never keep the engine in a restart loop;
    a streamed request that has reported tokens is failed rather than run again. ``state`` is ``restarting``
    meanwhile, and ``dead`` (with ``error``) if failures keep coming (a broken device): the worker then stops and
    answers nothing more, so no accepted request is failed for it; a new process runs them.
    """

    def __init__(self, engine: SteppingEngine, observer: ResultCallback | None = None) -> None:
        self.engine = engine
        self.observer = observer
        """Hears of every final result delivered (the metrics), from the worker thread."""
        self.error: BaseException | None = None
        """The last engine failure (kept after a successful restart, for the record)."""
        self.state: ClientState = "running"
        self.restarts = 0
        self.engines = 1
        self._cond = threading.Condition()
        self._pending: list[tuple[EngineRequest, ResultCallback]] = []
        self._aborts: list[str] = []
        self._prepared = False
        """A request's preparation finished since the thread last looked."""
        self._held: dict[str, tuple[EngineRequest, ResultCallback]] = {}
        """Every request submitted and not answered, in arrival order: what a restart submits again."""
        self._preparing: dict[str, list[Future[Any]]] = {}
        """Held requests not in the engine yet: what ``engine.prepare`` started for them (a grammar compiling, an
        adapter being read) is not done."""
        self._streamed: set[str] = set()
        """Held requests that have reported partial results."""
        self._strikes: Strikes[str] = Strikes()
        self._probation: deque[str] = deque()
        """Held requests with a strike waiting for their turn on probation."""
        self._failures: deque[float] = deque()
        self._stopping = False
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._loop, name="batchgen-engine", daemon=True)

    @property
    def healthy(self) -> bool:
        return self.state == "running" and self._thread.is_alive()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_context_length(self) -> int:
        return self.engine.max_context_length

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def tasks(self) -> frozenset[Task]:
        return self.engine.tasks

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():  # (else its step still runs: the ranks go with this process)
            self.engine.close()

    def submit(self, requests: list[EngineRequest], on_result: ResultCallback) -> None:
        """Queue ``requests``; returns at once, whatever they hold (a grammar that compiles for seconds), and never
        raises for one of them: a request that cannot run is answered with its error."""
        with self._cond:
            self._pending.extend((request, on_result) for request in requests)
            self._cond.notify()

    def abort(self, request_ids: list[str]) -> None:
        """Cancel requests (queued or running) at the next step; no result is reported for them."""
        with self._cond:
            self._aborts.extend(request_ids)
            self._cond.notify()

    def stats(self) -> EngineStats:
        return self._stats

    def _idle(self) -> bool:
        """Nothing to do (under ``_cond``)."""
        return not (self._stopping or self._pending or self._aborts or self._prepared) and not (
            self.engine.has_unfinished_requests() or self._probation
        )

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._idle():
                    self._cond.wait(IDLE_CHECK_S)
                if self._stopping:
                    return
                idle = self._idle()
                if not idle:
                    pending, self._pending = self._pending, []
                    aborts, self._aborts = self._aborts, []
                    self._prepared = False
            if idle:  # asked outside the lock: a broken group takes a moment to name the rank (submit waits on it)
                if (fault := _idle_fault(self.engine)) is not None and not self._restart(fault):
                    return  # restarted now, not at the next request; or dead
                continue
            try:
                self._apply(pending, aborts)
                results = self.engine.step()
            except Exception as exc:
                if not self._restart(exc):
                    return  # dead: what it holds stays unanswered, to run again when the process restarts
                continue
            for result in results:
                self._deliver(result)
            self._stats = self.engine.stats()

    def _apply(self, pending: list[tuple[EngineRequest, ResultCallback]], aborts: list[str]) -> None:
        for request, callback in pending:
            self._held[request.request_id] = (request, callback)
            try:
                futures = self.engine.prepare(request)
            except Exception as exc:  # the request's own fault, whatever it is: it fails alone
                self._deliver(failed_result(request, exc))
                continue
            self._preparing[request.request_id] = futures
            for future in futures:
                future.add_done_callback(self._on_prepared)
        for request_id in aborts:
            self.engine.abort_request(request_id)
            self._release(request_id)
        ready = [request_id for request_id, futures in self._preparing.items() if all(f.done() for f in futures)]
        for request_id in ready:
            del self._preparing[request_id]
            self._add(self._held[request_id][0])
        self._admit_probation()

    def _on_prepared(self, _: Future[Any]) -> None:
        with self._cond:
            self._prepared = True
            self._cond.notify()

    def _add(self, request: EngineRequest) -> None:
        """Into the engine; an exception there is this request's alone: it is answered with it, and nothing of it
        stays in the engine (the engine is not restarted, nobody else is struck)."""
        try:
            self.engine.add_request(request)
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.engine.abort_request(request.request_id)
            self._deliver(failed_result(request, exc))

    def _deliver(self, result: EngineResult) -> None:
        held = self._release(result.request_id) if result.finished else self._held.get(result.request_id)
        if held is not None:
            if not result.finished:
                self._streamed.add(result.request_id)
            _call(functools.partial(held[1], result), f"result callback of {result.request_id}")
            if self.observer is not None and result.finished:
                _call(functools.partial(self.observer, result), "result observer")
        self._admit_probation()

    def _release(self, request_id: str) -> tuple[EngineRequest, ResultCallback] | None:
        self._streamed.discard(request_id)
        self._preparing.pop(request_id, None)
        if request_id in self._probation:
            self._probation.remove(request_id)
        self._strikes.left(request_id, forget=True)  # an id is never used again
        return self._held.pop(request_id, None)

    def _admit_probation(self) -> None:
        """Put the first struck request that waits into the engine, unless another is on probation there."""
        if self._probation and not self._strikes.waits(self._probation[0]):
            request_id = self._probation.popleft()
            self._strikes.entered(request_id)
            self._add(self._held[request_id][0])

    def _restart(self, exc: Exception) -> bool:
        """Empty the engine and give it back every request it held but the quarantined; ``False`` if the engine
        keeps failing."""
        logger.error("engine step failed; restarting the engine", exc_info=exc)
        self.error, self.state = _untraced(exc), "restarting"
        now = time.monotonic()
        self._failures.append(now)
        while self._failures and self._failures[0] < now - RESTART_WINDOW_S:
            self._failures.popleft()
        if len(self._failures) > MAX_RESTARTS:
            self.state = "dead"
            logger.error("the engine failed %d times within %.0f s; giving up", len(self._failures), RESTART_WINDOW_S)
            return False
        try:
            self._strikes.strike(self.engine.suspects())
            self.engine.reset()
            self._strikes.reset()
            self._probation.clear()
            for request_id, (request, _) in list(self._held.items()):
                if request_id in self._preparing:
                    continue  # not in the engine yet: it goes in once prepared
                if self._strikes.quarantined(request_id):
                    logger.error("request %s quarantined: the engine failed twice while running it", request_id)
                    self._deliver(self._quarantined(request))
                elif request_id in self._streamed:
                    self._deliver(cut_stream(request, repr(self.error)))
                elif self._strikes.struck(request_id):
                    self._probation.append(request_id)
                else:
                    self._add(request)
            self._admit_probation()
        except Exception as again:
            return self._restart(again)
        self.restarts += 1
        self.state = "running"
        return True

    def _quarantined(self, request: EngineRequest) -> EngineResult:
        message = (
            "The engine could not run this request: it was running each of the two times the engine failed; it is "
            f"not run again (last failure: {self.error!r})."
        )
        error = EngineError("server_error", message)
        return EngineResult(request.request_id, len(request.prompt_token_ids), error=error)


def _untraced(exc: BaseException) -> BaseException:
    """``exc`` (logged already), kept for the record without its tracebacks: their frames would keep what failed
    alive (a dead group's runner: its model shard and cache)."""
    seen: set[int] = set()
    links: list[BaseException | None] = [exc]
    while links:
        link = links.pop()
        if link is not None and id(link) not in seen:
            seen.add(id(link))
            link.__traceback__ = None
            links += [link.__cause__, link.__context__]
    return exc


def _idle_fault(engine: SteppingEngine) -> Exception | None:
    """What an idle engine found failed under it (``LLMEngine.idle_fault``: a rank of its group exited), if anything."""
    check = getattr(engine, "idle_fault", None)
    return check() if check is not None else None


def _call(callback: Callable[[], None], what: str) -> None:
    try:
        callback()
    except Exception:  # the caller's bug must not stop everyone else's requests
        logger.exception("%s failed", what)
