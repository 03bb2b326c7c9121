"""Offline batch: the server's batch loop with a plain-file store and no database or HTTP."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from batchgen.schemas import BatchError, BatchObject, BatchRequestCounts

from .batches.loop import BatchLoop
from .batches.stores import FileStore
from .engines import window_for
from .ids import new_batch_id
from .serving import BatchDefaults, OpenAIServing
from .serving.config import ServingConfig

if TYPE_CHECKING:
    from .engine import EngineClient


class InvalidInputFile(Exception):
    """The input file failed validation (as the server would fail the batch); nothing was run."""

    def __init__(self, errors: list[BatchError]) -> None:
        super().__init__(f"{len(errors)} invalid line(s)")
        self.errors = errors


@dataclass
class RunBatchSummary:
    total: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0


def run_batch(
    engine: EngineClient,
    input_path: Path,
    output_path: Path,
    errors_path: Path | None = None,
    defaults: BatchDefaults | None = None,
    progress: bool = True,
    serving_config: ServingConfig | None = None,
) -> RunBatchSummary:
    """Validate the whole file first (``InvalidInputFile`` if it fails, like the server), then run every line.

    Successes go to ``output_path``, requests that fail (unsupported parameters, prompts over the context) to
    ``errors_path`` (or the output when unset). The file is streamed and only the loop's window of requests is in
    the engine at a time, so memory stays flat on huge files.
    """
    with tqdm(unit="req", disable=not progress, dynamic_ncols=True) as bar:

        def show(fields: dict[str, Any]) -> None:
            bar.total = fields.get("total", bar.total)
            bar.n = fields.get("completed", 0) + fields.get("failed", 0)
            tokens_per_s = fields.get("output_tokens", 0) / max(time.monotonic() - start, 1e-9)
            bar.set_postfix_str(f"{tokens_per_s:,.0f} tok/s", refresh=True)

        store = FileStore(input_path, output_path, errors_path, on_update=show)
        serving = OpenAIServing.for_engine(engine, engine.config, serving_config or ServingConfig())
        loop = BatchLoop(store, serving, engine, capacity=2**62, window=window_for(engine))
        engine.start()
        start = time.monotonic()  # the engine is ready: from here on is the batch's time
        loop.start()
        try:
            loop.admit(offline_batch(defaults or BatchDefaults()), owner="", sequences=0).result()
            while not store.finished.wait(0.5):
                if engine.state == "dead":
                    raise RuntimeError(f"the engine stopped: {engine.error}") from engine.error
            seconds = time.monotonic() - start  # not the shutdown: ending replicas on Ray takes seconds
        finally:
            loop.stop()
            engine.stop()
    fields = store.fields
    if fields["status"] == "failed":
        errors = fields["errors"].data
        if errors[0].code == "internal_error":
            raise RuntimeError(errors[0].message)
        raise InvalidInputFile(errors)
    return RunBatchSummary(
        total=fields["total"],
        completed=fields["completed"],
        failed=fields["failed"],
        prompt_tokens=fields["input_tokens"],
        completion_tokens=fields["output_tokens"],
        seconds=seconds,
    )


def offline_batch(defaults: BatchDefaults) -> BatchObject:
    """The one batch of a run-batch: its endpoint comes from the file, it never expires."""
    return BatchObject(
        id=new_batch_id(),
        endpoint="",
        input_file_id="",
        completion_window="24h",
        status="validating",
        created_at=int(time.time()),
        request_counts=BatchRequestCounts(),
        **{name: getattr(defaults, name) for name in BatchDefaults.__struct_fields__},
    )
