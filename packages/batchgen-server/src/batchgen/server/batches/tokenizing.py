"""Request lines become engine requests (the chat template, the tokenizer, images decoded: tens of ms, a second for
large pictures) in a thread of its own, so that the batch loop's thread goes on meanwhile with every other batch's
messages and results.

Each outcome comes back to the loop as a message. A line whose images are fetched over the network waits for them
on the fetcher's own loop first (``OpenAIServing.fetch_images``), holding no thread; a tenant has at most
``MAX_FETCHING`` lines at that stage (the feeder takes no more of its lines meanwhile), so a host that never answers
holds a few of the window's places, not all of them. Then each tenant's lines are tokenized in the order they came,
the tenants in turn: a tenant whose lines are slow to prepare delays another's next line by one of its own at most.
A line whose pictures find no room in the server's pixel budget steps aside and is tried again once some is given
back, the others going on meanwhile. The work is mostly Python (the template), which more threads would not speed up.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial

from batchgen.schemas import RequestBody

from ..media.fetcher import Fetched
from ..media.files import files_of
from ..serving import BatchDefaults, OpenAIServing, PreparedRequest, RequestRejected

Outcome = PreparedRequest | Exception
"""The line made ready to run (its engine requests), or why it is not (``RequestRejected``, a storage fault, a
bug)."""
MAX_FETCHING = 8
"""A tenant's lines waiting for their pictures at once (the fetcher takes ``PER_TENANT`` of their URLs at a time, the
rest waiting their turn there): enough to keep its fetches busy, few of the window's places."""


@dataclass(frozen=True, slots=True)
class _Job:
    body: RequestBody
    request_id: str
    defaults: BatchDefaults
    done: Callable[[Outcome], None]
    owner: str
    """The batch's tenant: the uploaded images its lines may name, and its turn."""
    fetched: Fetched | None = None


class Tokenizer:
    def __init__(self, serving: OpenAIServing, post: Callable[[Callable[[], None]], None]) -> None:
        """``post`` hands a message to the loop's thread."""
        self.serving = serving
        self._post = post
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()
        """Each tenant's lines waiting, in order; the tenant first in it has the next turn."""
        self._fetching: Counter[str] = Counter()
        """Each tenant's lines waiting for their pictures."""
        self._ready = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="batchgen-tokenizer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Drop the lines that wait, finish the one at hand, and end."""
        with self._ready:
            self._stopping = True
            self._queues.clear()
            self._ready.notify()
        self._thread.join()

    def fetching_full(self, owner: str) -> bool:
        """``owner`` has as many lines waiting for their pictures as it may: take no more of its lines for now."""
        with self._ready:
            return self._fetching[owner] >= MAX_FETCHING

    def put(
        self,
        body: RequestBody,
        *,
        request_id: str,
        defaults: BatchDefaults,
        done: Callable[[Outcome], None],
        owner: str = "",
    ) -> None:
        """Tokenize ``body``, once its remote images are fetched; ``done`` runs on the loop's thread with the
        outcome."""
        job = _Job(body, request_id, defaults, done, owner)
        try:
            fetching = self.serving.fetch_images(body, owner)
        except Exception as exc:  # the line's refusal (a RequestRejected) or its 500, as any outcome
            self._post(partial(done, exc))
            return
        if fetching is None:
            self._queue(job)
            return
        with self._ready:
            self._fetching[owner] += 1
        fetching.add_done_callback(partial(self._fetched, job))

    def _fetched(self, job: _Job, fetching: Future[Fetched]) -> None:
        with self._ready:
            self._fetching[job.owner] -= 1
            if not self._fetching[job.owner]:
                del self._fetching[job.owner]
        try:
            fetched = fetching.result()  # each URL's own failure is in it: this raises only on a bug
        except Exception as exc:
            self._post(partial(job.done, exc))
            return
        self._queue(replace(job, fetched=fetched))

    def _queue(self, job: _Job) -> None:
        with self._ready:
            if self._stopping:
                return
            self._queues.setdefault(job.owner, deque()).append(job)
            self._ready.notify()

    def _next(self) -> _Job | None:
        """The next tenant's oldest line (``None``: stopping); that tenant's turn passes to the others."""
        with self._ready:
            self._ready.wait_for(lambda: self._stopping or bool(self._queues))
            if self._stopping:
                return None
            owner, jobs = next(iter(self._queues.items()))
            job = jobs.popleft()
            self._queues.move_to_end(owner)
            if not jobs:
                del self._queues[owner]
            return job

    def _run(self) -> None:
        budget = self.serving.preparer.images.budget
        while (job := self._next()) is not None:
            outcome: Outcome
            try:
                with files_of(job.owner):
                    outcome = self.serving.prepare(
                        job.body, request_id=job.request_id, defaults=job.defaults, fetched=job.fetched
                    )
            except RequestRejected as exc:
                if exc.status_code == 429:  # no room for its pictures now: again once some is given back
                    budget.on_room(partial(self._queue, job))
                    continue
                outcome = exc
            except Exception as exc:  # the loop decides: the line's error, or a storage fault that pauses its batch
                outcome = exc
            self._post(partial(job.done, outcome))
