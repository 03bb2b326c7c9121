"""One engine replica: the body of a Ray actor (``ray_cluster`` wraps it), running in its own process, on its own GPU
where there is one.

It holds an ``EngineWorker`` around its ``LLMEngine``, so a replica steps, fails a poisoned request and restarts its
engine in place exactly as the single in-process engine does. Finished results wait in an outbox that the server
collects with ``poll`` (a long poll: it answers as soon as there is something, or after ``timeout``), so results
stream back as they finish. Requests cross as the engine's own dataclasses, pickled whole, so a field added to
``EngineRequest`` or ``EngineResult`` travels without a change here.

``submit`` is idempotent (a request id it already holds is ignored): after a lost connection the server may send a
request again without it ever running twice here.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine.errors import ModelLoadError
from ..engine.request import EngineRequest, EngineResult, Task

if TYPE_CHECKING:
    from ..engine import EngineStats
    from ..engine.config import EngineConfig
    from ..engine.interface import ClientState
    from ..engine.worker import EngineWorker


def is_final(result: EngineResult) -> bool:
    """The last result of its request (an engine that streams partial results marks them ``finished=False``)."""
    return bool(getattr(result, "finished", True))


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the server needs of the model without loading it: what ``OpenAIServing`` and ``/v1/models`` use."""

    tokenizer: Any
    model_name: str
    max_context_length: int
    vocab_size: int
    tasks: frozenset[Task]


@dataclass(slots=True)
class Report:
    """A replica's answer to ``poll``: the results finished since the last one, and how it is."""

    incarnation: str
    """Made anew each time the actor starts: a different one means the replica was restarted and lost its requests."""
    pid: int
    node: str
    state: ClientState
    """Its engine worker's: ``running``, ``restarting`` (the engine restarts in place, nothing lost) or ``dead``."""
    error: str | None
    stats: EngineStats | None
    results: list[EngineResult] = field(default_factory=list)


class Replica:
    def __init__(self, config: EngineConfig, environ: Mapping[str, str]) -> None:
        os.environ.update(environ)  # the server's model settings (cache directory, hub token) reach this process
        from ..engine import EngineWorker, build_engine

        self.incarnation = uuid.uuid4().hex
        self._cond = threading.Condition()
        self._outbox: list[EngineResult] = []
        self._held: set[str] = set()
        self.worker: EngineWorker | None = None
        try:
            engine = build_engine(config)
        except ModelLoadError as exc:  # said in one line by ``describe``, not as an actor's traceback
            self.described: ModelInfo | str = str(exc)
            return
        self.described = ModelInfo(
            engine.tokenizer, engine.model_name, engine.max_context_length, engine.vocab_size, engine.tasks
        )
        self.worker = EngineWorker(engine)
        self.worker.start()

    def describe(self) -> ModelInfo | str:
        """The model, or why it could not be loaded."""
        return self.described

    def submit(self, requests: list[EngineRequest]) -> None:
        assert self.worker is not None
        with self._cond:
            new = [request for request in requests if request.request_id not in self._held]
            self._held.update(request.request_id for request in new)
        self.worker.submit(new, self._finished)

    def abort(self, request_ids: list[str]) -> None:
        assert self.worker is not None
        with self._cond:
            self._held.difference_update(request_ids)
        self.worker.abort(request_ids)

    def poll(self, timeout: float) -> Report:
        with self._cond:
            self._cond.wait_for(lambda: self._outbox, timeout)
            results, self._outbox = self._outbox, []
        worker = self.worker
        if worker is None:
            return Report(self.incarnation, os.getpid(), socket.gethostname(), "dead", str(self.described), None)
        error = None if worker.error is None else repr(worker.error)
        return Report(self.incarnation, os.getpid(), socket.gethostname(), worker.state, error, worker.stats(), results)

    def _finished(self, result: EngineResult) -> None:
        with self._cond:
            if is_final(result):
                self._held.discard(result.request_id)
            self._outbox.append(result)
            self._cond.notify()
