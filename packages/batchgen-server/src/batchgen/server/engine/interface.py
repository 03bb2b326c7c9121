"""What the rest of the server depends on of an engine: protocols, with the stats beside them. Imports nothing heavy
(no torch), so the API, the batch loop, the replicas and the metrics name engines without loading one.

- ``ServedModel``: what a loaded model offers the serving layer and ``/v1/models`` (its tokenizer, names, limits).
- ``SteppingEngine``: what the worker thread steps (``LLMEngine``, ``EncoderEngine``).
- ``EngineClient``: what the server, the batch loop and run-batch drive from other threads (``EngineWorker`` over
  one engine, ``ReplicaPool`` over several): submit with a callback, abort, watch its state.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .request import EngineRequest, EngineResult, Task

if TYPE_CHECKING:
    from .config import EngineConfig

ResultCallback = Callable[[EngineResult], None]
ClientState = Literal["running", "restarting", "dead"]
"""``restarting``: the engine is being emptied and refilled after a failure (nothing accepted is lost); ``dead``: it
gave up (a broken device), and what it held waits for the next process."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    queued: int
    """Sequences waiting to be (re)admitted."""
    running: int
    kv_blocks_total: int
    kv_blocks_free: int
    prompt_tokens: int
    """Totals since start, counted as the engine goes: prompt tokens of requests whose prompt is computed, of which
    served from the prefix cache; tokens generated."""
    cached_tokens: int
    generated_tokens: int
    preemptions: int
    kv_cache_tokens: int = 0
    """The KV cache's capacity: tokens (its blocks times the block size), and bytes (every layer's K and V)."""
    kv_cache_bytes: int = 0
    kv_cache_dtype: str = ""
    """Its dtype (``bfloat16``...: ``--kv-cache-dtype``, or the model's); empty for an engine with none."""
    state_slots: int = 0
    """Models with state layers (recurrent mixers, short convolutions): the state cache's slots (one per running
    sequence, and the prefix checkpoints), the checkpoints held, what one sequence's state costs and the whole cache
    (counted in the same memory budget as the KV cache)."""
    state_checkpoints: int = 0
    state_bytes_per_seq: int = 0
    state_cache_bytes: int = 0
    fast_paths: tuple[tuple[str, str | None], ...] = ()
    """Each fast path (``fast_paths.py``) by name, with why it is off (``None`` while on)."""


class ServedModel(Protocol):
    """A loaded model, as the serving layer and ``/v1/models`` see it."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_context_length(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """The rows of its embedding: the token ids a request may name are ``0`` to ``vocab_size - 1``."""
        ...

    @property
    def tasks(self) -> frozenset[Task]:
        """What it runs: ``generate`` and ``embed`` (a causal LM), or ``embed`` alone (an encoder)."""
        ...


class SteppingEngine(ServedModel, Protocol):
    """An engine one thread steps: requests in, ``step()``, results out. None of it is thread-safe."""

    @property
    def config(self) -> EngineConfig: ...

    def prepare(self, request: EngineRequest) -> list[Future[Any]]:
        """Start what ``request`` needs before it is added (compiling its grammar, reading its adapter), each in a
        thread of its own; returns at once. Once every future is done, ``add_request`` waits on nothing. Thread-safe."""
        ...

    def add_request(self, request: EngineRequest) -> None:
        """Admit ``request``; one it can never run is answered (an error result) by the next ``step``."""
        ...

    def abort_request(self, request_id: str) -> bool:
        """Drop a request at once (no result is produced for it); ``False`` if it is unknown or already done."""
        ...

    def step(self) -> list[EngineResult]:
        """Run one step; the results of the requests that finished, and the partial results of streamed ones."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def suspects(self) -> list[str]:
        """After ``step`` raised: the requests it was running (the worker strikes them before ``reset``)."""
        ...

    def reset(self) -> None:
        """Forget every request (the weights stay): how the worker recovers from a step that raised."""
        ...

    def close(self) -> None:
        """Let go of what outlives the engine object: a split model's worker ranks and its process group."""
        ...

    def stats(self) -> EngineStats: ...


class EngineSubmitter(Protocol):
    """What the batch loop needs: requests in, each result to its callback (from another thread), aborts by id."""

    def submit(self, requests: list[EngineRequest], on_result: ResultCallback) -> None: ...

    def abort(self, request_ids: list[str]) -> None:
        """Cancel requests wherever they are; no result is reported for them."""
        ...


class EngineClient(EngineSubmitter, ServedModel, Protocol):
    """The engine as the server drives it, thread-safe, from the event loop and the batch loop's thread."""

    error: BaseException | None
    """The last failure (kept after a successful restart, for the record)."""
    observer: ResultCallback | None
    """Hears of every final result delivered (the metrics), from the engine's thread."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def state(self) -> ClientState: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def restarts(self) -> int: ...

    @property
    def engines(self) -> int:
        """How many engines it drives (one, or the replicas): the batch loop's window scales with it."""
        ...

    def start(self) -> None: ...

    def stop(self, timeout: float | None = None) -> None: ...

    def stats(self) -> EngineStats: ...
