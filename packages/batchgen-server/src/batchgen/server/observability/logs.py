"""Logs an operator can read: text or JSON lines, and a periodic line on what the engine is doing while it is busy."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from ..engine.interface import EngineStats

log = logging.getLogger("batchgen.server")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (and the traceback, when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever ``sys.stderr`` is when a record arrives, not the stream it was when the handler was made
    (a test's or an embedding application's replaced stderr may be closed by then)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def configure(level: str, fmt: str) -> None:
    """The root logger at ``level``, in ``text`` or ``json``."""
    handler = StderrHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # httpx logs each request's URL at INFO: an image's or a callback's query string may carry a signature.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


async def log_activity(stats: Callable[[], EngineStats], active_batches: Callable[[], int], interval_s: float) -> None:
    """Every ``interval_s`` while the engine has work: throughput since the last line, running and waiting
    sequences, KV-cache use and active batches. Quiet while idle."""
    previous, since = stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        now, current = time.monotonic(), stats()
        elapsed = max(now - since, 1e-9)
        generated = (current.generated_tokens - previous.generated_tokens) / elapsed
        prompt = (current.prompt_tokens - previous.prompt_tokens) / elapsed
        batches = active_batches()
        if current.running or current.queued or batches or generated:
            used = 1 - current.kv_blocks_free / current.kv_blocks_total if current.kv_blocks_total else 0.0
            log.info(
                "engine: %.1f generated tokens/s, %.1f prompt tokens/s; %d running, %d waiting; KV cache %.0f%% used;"
                " %d active batch(es)",
                generated,
                prompt,
                current.running,
                current.queued,
                100 * used,
                batches,
            )
        previous, since = current, now
