"""The HTTP connections the server holds, bounded in number and in idle time, whatever the API-key configuration.

- A connection must send a whole request head within ``--request-start-timeout-s`` of opening, or of the answer to
  its previous request (keep-alive): a client that connects and sends nothing, or a byte at a time, is closed.
- At most ``--max-connections`` are open, below the process's descriptor limit, so that sockets never take the
  descriptors storage needs. A connection past the cap takes the place of the one that has been idle the longest
  (nginx's way: a fresh client gets in while idle ones wait); with none idle it is answered 503 and closed.
- ``accept()`` failing for want of descriptors (EMFILE, ENFILE) is logged once per episode, not once a second.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from typing import Any

import msgspec
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from batchgen.schemas import ErrorDetail, ErrorResponse

log = logging.getLogger("batchgen.server")

DESCRIPTORS_WANTED = 65536
"""The soft descriptor limit the server asks for, when the hard limit allows it (systemd's soft default is 1024)."""


def descriptor_limit() -> int:
    """The process's soft descriptor limit, first raised towards the hard one."""
    try:
        import resource
    except ImportError:  # Windows: no such limit to raise
        return DESCRIPTORS_WANTED
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = DESCRIPTORS_WANTED if hard == resource.RLIM_INFINITY else min(hard, DESCRIPTORS_WANTED)
    if wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return soft


def connection_limits(descriptors: int) -> tuple[int, int]:
    """(most connections held, most accepted at once) for a process with ``descriptors``. asyncio accepts up to its
    listen backlog in one go, before any of them is admitted or refused, so both fit under the limit, with an eighth
    (64 at least) left for everything else: the database, blobs being read and written, the engine's libraries."""
    backlog = min(2048, max(16, descriptors // 8))
    return max(16, descriptors - backlog - max(64, descriptors // 8)), backlog


_REFUSAL_BODY = msgspec.json.encode(
    ErrorResponse(
        error=ErrorDetail(
            message="The server holds as many connections as it can, all busy; retry shortly.",
            type="server_error",
            param=None,
            code="too_many_connections",
        )
    )
)
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\n"
    + b"content-length: %d\r\n\r\n" % len(_REFUSAL_BODY)
    + _REFUSAL_BODY
)


class ConnectionGuard:
    """The open connections, and which of them are idle (no request in progress) since when."""

    def __init__(self, max_connections: int, request_start_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.request_start_timeout_s = request_start_timeout_s
        self._open: set[Any] = set()
        self._idle: dict[Any, asyncio.TimerHandle] = {}
        """Idle connections, oldest first, each with its deadline to start a request."""
        self._refusing = False
        self._accept_failures = 0

    @property
    def open(self) -> int:
        return len(self._open)

    def admit(self, connection: Any) -> bool:
        """Make room for a new connection (closing the one idle the longest if the cap is reached); ``False`` if
        every open connection is busy."""
        if self._accept_failures:
            log.warning("accepting connections again (%d accept(s) had failed)", self._accept_failures)
            self._accept_failures = 0
        if len(self._open) >= self.max_connections:
            if not self._idle:
                if not self._refusing:
                    log.warning("%d connections open, all busy: refusing new ones (--max-connections)", self.open)
                self._refusing = True
                return False
            self._close(next(iter(self._idle)))
        self._refusing = False
        self._open.add(connection)
        return True

    def idle(self, connection: Any) -> None:
        """``connection`` waits for a request: it has until its deadline to send a whole request head."""
        self._busy(connection)
        loop = asyncio.get_running_loop()
        self._idle[connection] = loop.call_later(self.request_start_timeout_s, self._close, connection)

    def _busy(self, connection: Any) -> None:
        timer = self._idle.pop(connection, None)
        if timer is not None:
            timer.cancel()

    def busy(self, connection: Any) -> None:
        """A request of ``connection`` is in progress: no deadline, not a candidate for eviction."""
        self._busy(connection)

    def forget(self, connection: Any) -> None:
        self._busy(connection)
        self._open.discard(connection)

    def _close(self, connection: Any) -> None:
        self.forget(connection)
        if connection.transport is not None and not connection.transport.is_closing():
            connection.transport.close()

    def accept_failed(self, context: dict[str, Any]) -> bool:
        """Whether ``context`` (the event loop's exception handler's) is a failed ``accept()`` for want of
        descriptors; the first of an episode is logged."""
        exc = context.get("exception")
        if not isinstance(exc, OSError) or exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            return False
        if not self._accept_failures:
            log.error(
                "cannot accept connections: %s (%d open); retrying each second until descriptors return",
                exc.strerror,
                self.open,
            )
        self._accept_failures += 1
        return True


def guarded_protocol(guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (h11 or httptools, whichever it would pick), its connections kept by ``guard``."""
    base: Any = AutoHTTPProtocol

    class GuardedHTTPProtocol(base):  # type: ignore[misc]
        _refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:
            if not guard.admit(self):
                self._refused = True
                transport.write(REFUSAL)
                transport.close()
                return
            super().connection_made(transport)
            guard.idle(self)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            guard.forget(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_request():
                guard.busy(self)  # else the deadline set when it went idle stands: bytes alone do not extend it

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self._in_request():
                guard.idle(self)

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

    return GuardedHTTPProtocol
