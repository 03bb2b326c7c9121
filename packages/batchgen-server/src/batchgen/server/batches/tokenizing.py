"""Request lines become engine requests (the chat template, the tokenizer: tens of ms for a long prompt) in a thread
of its own, so that the batch loop's thread goes on meanwhile with every other batch's messages and results.

Each outcome comes back to the loop as a message. One thread, first in first out: lines come back in the order the
loop sent them, so each batch's lines still reach the engine in input order, and the turns' order across batches
holds, with nothing to sort; the work is mostly Python (the template), which more threads would not speed up.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from batchgen.schemas import RequestBody

from ..media.files import files_of
from ..serving import BatchDefaults, OpenAIServing, PreparedRequest

Outcome = PreparedRequest | Exception
"""The line made ready to run (its engine requests), or why it is not (``RequestRejected``, a storage fault, a
bug)."""


@dataclass(frozen=True, slots=True)
class _Job:
    body: RequestBody
    request_id: str
    defaults: BatchDefaults
    done: Callable[[Outcome], None]
    owner: str
    """The batch's tenant: the uploaded images its lines may name."""


class Tokenizer:
    def __init__(self, serving: OpenAIServing, post: Callable[[Callable[[], None]], None]) -> None:
        """``post`` hands a message to the loop's thread."""
        self.serving = serving
        self._post = post
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="batchgen-tokenizer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Drop the lines that wait, finish the one at hand, and end."""
        self._stopping = True
        self._jobs.put(None)
        self._thread.join()

    def put(
        self,
        body: RequestBody,
        *,
        request_id: str,
        defaults: BatchDefaults,
        done: Callable[[Outcome], None],
        owner: str = "",
    ) -> None:
        """Tokenize ``body``; ``done`` runs on the loop's thread with the outcome."""
        self._jobs.put(_Job(body, request_id, defaults, done, owner))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None and not self._stopping:
            outcome: Outcome
            try:
                with files_of(job.owner):
                    outcome = self.serving.prepare(job.body, request_id=job.request_id, defaults=job.defaults)
            except Exception as exc:  # the loop decides: the line's error, or a storage fault that pauses its batch
                outcome = exc
            self._post(partial(job.done, outcome))
