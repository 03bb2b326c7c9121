"""``Idempotency-Key`` on creating POSTs: a retried request gets the object the first one created, never a twin."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from .deps import ServerContext, now
from .errors import invalid

IDEMPOTENCY_KEY = "Idempotency-Key"
MAX_KEY_LENGTH = 255


class _HasId(Protocol):
    id: str


T = TypeVar("T", bound=_HasId)

# One lock per key in flight, so two concurrent requests with the same key cannot both create (one process).
_locks: weakref.WeakValueDictionary[tuple[str, str, str], asyncio.Lock] = weakref.WeakValueDictionary()


async def idempotent(
    context: ServerContext,
    owner: str,
    route: str,
    key: str | None,
    create: Callable[[], Awaitable[T]],
    lookup: Callable[[str], T | None],
) -> T:
    """``create()`` once per key; later calls with the key return ``lookup(id)`` of what it created (as it is now).
    ``lookup`` reads the database: it runs off the event loop."""
    if key is None:
        return await create()
    if not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise invalid(f"The Idempotency-Key must have 1 to {MAX_KEY_LENGTH} characters.", param=IDEMPOTENCY_KEY)
    lock = _locks.setdefault((owner, route, key), asyncio.Lock())
    async with lock:
        existing_id = await asyncio.to_thread(context.db.idempotent_object, owner=owner, route=route, key=key)
        existing = None if existing_id is None else await asyncio.to_thread(lookup, existing_id)
        if existing is not None:
            return existing
        created = await create()
        await asyncio.to_thread(
            context.db.bind_idempotency_key, owner=owner, route=route, key=key, object_id=created.id, now=now()
        )
        return created
