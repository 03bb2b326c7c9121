"""The start-up heap is frozen out of the collector's sight, its garbage collected first (not kept for good)."""

from __future__ import annotations

import gc
import weakref

from batchgen.server import startup_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_freeze_collects_the_garbage_then_freezes_the_rest() -> None:
    kept, garbage = Node(), Node()
    dead = weakref.ref(garbage)
    del garbage
    try:
        startup_heap.freeze()
        assert dead() is None  # collected, not frozen
        assert gc.get_freeze_count() > 0
        assert not any(obj is kept for obj in gc.get_objects())  # in no generation a collection walks
    finally:
        gc.unfreeze()
    assert any(obj is kept for obj in gc.get_objects())
