"""Who puts the next request into the engine: the tenant with the fewest sequences in it, then that tenant's batch
with the fewest; ties go round-robin.

So a tenant with ten batches gets no more of the engine than a tenant with one, and a batch created behind a huge
one takes every free place until it holds as many as the huge one: a small batch finishes promptly whatever is
queued ahead of it. When every batch holds the same share, this is plain round-robin.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Turns(Generic[T]):
    def __init__(self) -> None:
        self._tenants: deque[str] = deque()
        self._items: dict[str, deque[T]] = {}

    def add(self, tenant: str, item: T) -> None:
        if tenant not in self._items:
            self._items[tenant] = deque()
            self._tenants.append(tenant)
        self._items[tenant].append(item)

    def remove(self, tenant: str, item: T) -> None:
        items = self._items.get(tenant)
        if items is None or item not in items:
            return
        items.remove(item)
        if not items:
            del self._items[tenant]
            self._tenants.remove(tenant)

    def next(self, ready: Callable[[T], bool], load: Callable[[T], int]) -> T | None:
        """The ready item whose tenant, then itself, has the least ``load``, the earliest in turn among equals; it
        and its tenant then go to the back of their queues."""
        candidates = [(tenant, [item for item in self._items[tenant] if ready(item)]) for tenant in self._tenants]
        candidates = [(tenant, items) for tenant, items in candidates if items]
        if not candidates:
            return None
        tenant, items = min(candidates, key=lambda pair: sum(map(load, self._items[pair[0]])))
        item = min(items, key=load)
        _to_back(self._tenants, tenant)
        _to_back(self._items[tenant], item)
        return item


def _to_back(queue: deque[T], item: T) -> None:
    queue.remove(item)
    queue.append(item)
