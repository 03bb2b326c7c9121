"""The polling decisions of ``wait_for_batch``, shared by both clients (which only fetch and sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable

from batchgen.schemas import BatchObject

from .errors import OUTCOME_ERRORS, BatchWaitTimeoutError
from .progress import BatchProgress, progress_wanted

BatchCallback = Callable[[BatchObject], None]


class BatchWaiter:
    """Feed it each polled batch object; it says how long to sleep, or returns/raises when the batch is done."""

    def __init__(
        self,
        batch_id: str,
        *,
        poll_interval: float,
        timeout: float | None,
        progress: bool | None,
        callback: BatchCallback | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._poll_interval = poll_interval
        self._timeout = timeout
        self._callback = callback
        self._clock = clock
        self._deadline = None if timeout is None else clock() + timeout
        self._progress = BatchProgress(batch_id) if progress_wanted(progress) else None

    def observe(self, batch: BatchObject) -> float | None:
        """``None`` once the batch completed; else the seconds to sleep before the next poll.

        Raises the batch's outcome error when it failed, was cancelled or expired, and ``BatchWaitTimeoutError``
        once the timeout has passed.
        """
        if self._progress is not None:
            self._progress.update(batch)
        if self._callback is not None:
            self._callback(batch)
        if batch.status == "completed":
            return None
        if batch.status in OUTCOME_ERRORS:
            raise OUTCOME_ERRORS[batch.status](batch)
        if self._deadline is None:
            return self._poll_interval
        remaining = self._deadline - self._clock()
        if remaining <= 0:
            assert self._timeout is not None
            raise BatchWaitTimeoutError(batch, self._timeout)
        # Poll once more right at the deadline rather than overshooting it.
        return min(self._poll_interval, remaining)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
