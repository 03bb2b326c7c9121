"""Whose turn it is to put a request into the engine: tenants in turn, and each tenant's batches in turn.

A tenant with ten batches gets no more turns than a tenant with one, and a batch of ten requests gets as many turns
as one of fifty thousand, so a small batch finishes promptly behind a huge one.
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

    def next(self, ready: Callable[[T], bool]) -> T | None:
        """The first ready item in turn order; it and its tenant then go to the back of their queues."""
        for _ in range(len(self._tenants)):
            tenant = self._tenants[0]
            self._tenants.rotate(-1)
            items = self._items[tenant]
            for _ in range(len(items)):
                item = items[0]
                items.rotate(-1)
                if ready(item):
                    return item
        return None
