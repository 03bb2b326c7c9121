"""Online requests made ready to run (the chat template, the tokenizer, images decoded: tens of ms, a second for
large pictures), uploaded images checked and batches' grammars compiled, in threads of their own rather than
asyncio's default executor, which the API's storage calls share: six slow requests there once held every call of
every other tenant (files, batches, models) for as long as they took. One tenant holds at most half of these
threads; its other requests wait their turn on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class Preparations:
    def __init__(self, threads: int = min(32, (os.cpu_count() or 1) + 4), *, tenants: bool = True) -> None:
        """``threads``: as many as asyncio's default executor has (the pool prepare ran in before); ``tenants``:
        the server has several (API keys), each held to half of them; one alone takes them all."""
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="batchgen-prepare")
        self.per_tenant = max(1, threads // 2) if tenants else threads
        self._tenants: dict[str, asyncio.Semaphore] = {}
        """Tenants are API keys, a list the operator gives: one semaphore each, kept."""

    async def run(self, owner: str, work: Callable[[], T]) -> T:
        """``work()`` in one of the threads, in the caller's context (its tenant's files), once ``owner`` holds
        fewer than ``per_tenant`` of them. A thread is held until ``work`` ends, even when the caller leaves first
        (a client gone does not free its place early)."""
        places = self._tenants.setdefault(owner, asyncio.Semaphore(self.per_tenant))
        await places.acquire()
        loop = asyncio.get_running_loop()
        try:
            running: Future[T] = self._threads.submit(contextvars.copy_context().run, work)
        except BaseException:
            places.release()
            raise

        def release(_: Future[T]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the server stopped)
                loop.call_soon_threadsafe(places.release)

        running.add_done_callback(release)
        return await asyncio.wrap_future(running)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
