"""The objects a server made to start (modules, the model, compiled graphs, the engine) frozen out of the garbage
collector's sight, as vLLM does (``freeze_gc_heap``): a full collection walks every tracked object, half a million
once torch and transformers are imported, which is a pause of 0.2-0.6 s on this machine's CPUs taken from the engine's
thread too, in the middle of a step: the longest gaps between a stream's tokens. Frozen, a full collection walks only
what serving made since."""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze() -> None:
    """Collect the start-up garbage, then freeze what is left (``gc.unfreeze`` gives it back at shutdown)."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.debug("froze %d start-up objects in %.2f s", gc.get_freeze_count(), time.perf_counter() - start)
