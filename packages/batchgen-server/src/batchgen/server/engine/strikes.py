"""What becomes of a request that was running when something failed beneath it: one policy for the engine worker
(an engine step that failed, keyed by engine request id) and the batch loop (the whole process died, keyed by batch
and custom_id, the strikes kept in its crash journal).

Each such request gets a strike. A struck request runs on probation, never beside another struck one, so a second
failure is pinned on one request; one with two strikes is quarantined: answered with an error instead of run, so no
request can keep the engine (or the server) failing. A request that has streamed part of its output is not run again
at all: a new run would not continue what it streamed, which cannot be taken back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

from .request import EngineError, EngineRequest, EngineResult

STRIKES_TO_QUARANTINE = 2
K = TypeVar("K", bound=Hashable)


class Strikes(Generic[K]):
    def __init__(self) -> None:
        self.counts: Counter[K] = Counter()
        self.on_probation: K | None = None
        """The one struck request inside, if any."""

    def strike(self, keys: Iterable[K]) -> None:
        for key in keys:
            self.counts[key] += 1

    def withdraw(self, keys: Iterable[K]) -> None:
        """Take back a strike each: what they were struck for did not happen after all."""
        for key in keys:
            if self.counts[key] > 0:
                self.counts[key] -= 1
            if not self.counts[key]:
                del self.counts[key]

    def struck(self, key: K) -> bool:
        return self.counts[key] > 0

    def quarantined(self, key: K) -> bool:
        return self.counts[key] >= STRIKES_TO_QUARANTINE

    def waits(self, key: K) -> bool:
        """It is struck and another request is on probation: it goes in once that one has left."""
        return self.struck(key) and self.on_probation not in (None, key)

    def entered(self, key: K) -> None:
        """It went in (not while it ``waits``): on probation if it is struck."""
        if self.struck(key):
            self.on_probation = key

    def left(self, key: K, *, forget: bool) -> None:
        """It is no longer inside, its probation (if any) over; ``forget`` its strikes once it has been answered or
        will never run again."""
        if forget:
            self.counts.pop(key, None)
        if self.on_probation == key:
            self.on_probation = None

    def reset(self) -> None:
        """Nothing is inside any more (the engine was emptied); the strikes stay."""
        self.on_probation = None


def cut_stream(request: EngineRequest, failure: object) -> EngineResult:
    """The final result of a request that ``failure`` would have run again but that has streamed part of its
    output."""
    message = (
        f"The engine failed after this request had streamed part of its output ({failure}); a new run would not "
        "continue what it streamed, which cannot be taken back, so it is not run again."
    )
    error = EngineError("server_error", message)
    return EngineResult(request.request_id, len(request.prompt_token_ids), error=error)
