"""EngineWorker: runs the engine's steps in a background thread for a server that must not block."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

from .engine import EngineStats, LLMEngine
from .request import EngineRequest, EngineResult

logger = logging.getLogger(__name__)

ResultCallback = Callable[[EngineResult], None]


class EngineWorker:
    """Thread-safe front of an ``LLMEngine``: submissions and aborts are queued and applied between steps.

    Each finished request's callback is invoked from the worker thread. When idle the thread sleeps on a condition
    variable (no busy loop). If a step raises, the loop stops, ``healthy`` turns ``False`` and ``error`` holds the
    exception.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._pending: list[tuple[EngineRequest, ResultCallback]] = []
        self._aborts: list[str] = []
        self._callbacks: dict[str, ResultCallback] = {}
        self._stopping = False
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._loop, name="batchgen-engine", daemon=True)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def submit(self, requests: list[EngineRequest], on_result: ResultCallback) -> None:
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

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._pending or self._aborts) and not (
                        self.engine.has_unfinished_requests()
                    ):
                        self._cond.wait()
                    if self._stopping:
                        return
                    pending, self._pending = self._pending, []
                    aborts, self._aborts = self._aborts, []
                for request, callback in pending:
                    self._callbacks[request.request_id] = callback
                    self.engine.add_request(request)
                for request_id in aborts:
                    self.engine.abort_request(request_id)
                    self._callbacks.pop(request_id, None)
                for result in self.engine.step():
                    on_result = self._callbacks.pop(result.request_id, None)
                    if on_result is not None:
                        _call(functools.partial(on_result, result), f"result callback of {result.request_id}")
                self._stats = self.engine.stats()
        except BaseException as exc:
            logger.exception("engine loop died")
            self.error = exc


def _call(callback: Callable[[], None], what: str) -> None:
    try:
        callback()
    except Exception:  # the caller's bug must not stop everyone else's requests
        logger.exception("%s failed", what)
