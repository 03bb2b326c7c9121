"""Completion callbacks: POST the final batch object to ``metadata.ds_batch_finish_callback``.

No server-side request forgery by default: callbacks are off until the operator lists the hosts they may reach
(``callback_allowed_hosts``). A URL must be http(s), carry no credentials and name an allowed host exactly (no DNS
lookup decides anything); it is parsed once, by httpx, and that same parsed URL is what gets requested, so no
second parser can read it differently. Redirects are not followed. Delivery is at least once within the bounded
retries (receivers deduplicate on the ``Idempotency-Key`` header, the batch id) and is not persisted across a
server restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import httpx
import msgspec

from batchgen.schemas import BatchObject

from .security.limits import LimitError

log = logging.getLogger("batchgen.server.callbacks")

CALLBACK_METADATA_KEY = "ds_batch_finish_callback"
USER_AGENT = "batchgen-callback/0.1"


@dataclass(frozen=True, slots=True)
class CallbackSettings:
    allowed_hosts: frozenset[str] = frozenset()
    """Host names or IP literals callbacks may reach, matched exactly (any port); empty disables callbacks."""
    max_attempts: int = 5
    initial_backoff_s: float = 1.0
    """Wait after the first failed attempt; doubled after each further failure, up to ``max_backoff_s``."""
    max_backoff_s: float = 60.0
    timeout_s: float = 10.0
    """Per attempt: connect, send and read the answer."""


class CallbackUrlError(LimitError):
    """A callback URL the server will not call; at batch creation this is a 400 on the metadata key."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param=f"metadata.{CALLBACK_METADATA_KEY}")


def _normalize_host(host: str) -> str:
    return host.strip().strip("[]").rstrip(".").lower()


def check_callback_url(url: str, allowed_hosts: Collection[str]) -> httpx.URL:
    """The parsed URL to call, or :class:`CallbackUrlError` saying why it may not be called."""
    if not allowed_hosts:
        raise CallbackUrlError(
            f"'metadata.{CALLBACK_METADATA_KEY}' is set but completion callbacks are disabled on this server "
            "(the operator enables them for chosen hosts with BATCHGEN_CALLBACK_ALLOWED_HOSTS)."
        )
    try:
        return checked_url(url, allowed_hosts, "callback")
    except ValueError as exc:
        raise CallbackUrlError(str(exc)) from None


def checked_url(
    url: str, allowed_hosts: Collection[str], what: str, schemes: tuple[str, ...] = ("http", "https")
) -> httpx.URL:
    """The SSRF guard (completion callbacks, fetched images): ``url`` parsed once, by httpx, in one of ``schemes``,
    with no credentials, naming an allowed host exactly (no DNS lookup decides anything); that parsed URL is what
    gets requested. ``ValueError`` says why not (``what``: the URL's use, in the message)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"The {what} URL is not a valid URL: {exc}.") from None
    if parsed.scheme not in schemes:
        raise ValueError(f"The {what} URL must be {' or '.join(schemes)}, not {parsed.scheme or 'relative'!r}.")
    if parsed.userinfo:
        raise ValueError(f"The {what} URL must not carry credentials (user:password@).")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise ValueError(f"The {what} URL's port must be from 1 to 65535, not {parsed.port}.")
    host = _normalize_host(parsed.host)
    if not host or host not in {_normalize_host(allowed) for allowed in allowed_hosts}:
        raise ValueError(f"The {what} host {parsed.host!r} is not on this server's list of allowed hosts.")
    return parsed


def callback_url(metadata: Mapping[str, str] | None) -> str | None:
    return None if metadata is None else metadata.get(CALLBACK_METADATA_KEY)


def check_callback_metadata(metadata: Mapping[str, str] | None, settings: CallbackSettings) -> None:
    """At batch creation: refuse a callback the server would not deliver, rather than drop it silently later."""
    url = callback_url(metadata)
    if url is not None:
        check_callback_url(url, settings.allowed_hosts)


@dataclass(frozen=True, slots=True)
class DeliveryOutcome:
    delivered: bool
    attempts: int
    detail: str
    """The last answer or error, for the log."""


def _retryable(status_code: int) -> bool:
    return status_code >= 500 or status_code in (408, 429)


async def deliver(
    client: httpx.AsyncClient, url: httpx.URL, batch: BatchObject, settings: CallbackSettings
) -> DeliveryOutcome:
    """POST ``batch`` to ``url`` until a 2xx, a non-retryable answer, or ``max_attempts`` attempts."""
    body = msgspec.json.encode(batch)
    headers = {"content-type": "application/json", "user-agent": USER_AGENT, "idempotency-key": batch.id}
    backoff = settings.initial_backoff_s
    attempt = 0
    while True:
        attempt += 1
        try:
            response = await client.post(url, content=body, headers=headers, timeout=settings.timeout_s)
        except httpx.HTTPError as exc:
            detail, retry = f"{type(exc).__name__}: {exc}", True
        else:
            detail = f"HTTP {response.status_code}"
            if response.is_success:
                return DeliveryOutcome(True, attempt, detail)
            retry = _retryable(response.status_code)
        if not retry or attempt >= settings.max_attempts:
            return DeliveryOutcome(False, attempt, detail)
        log.info("callback for %s: attempt %d failed (%s); retrying in %.1fs", batch.id, attempt, detail, backoff)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, settings.max_backoff_s)


class CallbackNotifier:
    """Delivers callbacks in the background of the server's event loop; ``notify`` may be called from any thread.

    Lifespan: ``await notifier.start()`` on startup, ``await notifier.stop()`` on shutdown.
    """

    def __init__(self, settings: CallbackSettings) -> None:
        self.settings = settings
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[DeliveryOutcome]] = set()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # No proxies from the environment, no redirects: the request goes exactly where the checked URL says.
        self._client = httpx.AsyncClient(follow_redirects=False, trust_env=False)

    def notify(self, batch: BatchObject) -> None:
        """Send ``batch`` (in a terminal state) to its callback URL, if it has one the settings allow."""
        url = callback_url(batch.metadata)
        if url is None or self._loop is None:
            return
        try:
            parsed = check_callback_url(url, self.settings.allowed_hosts)
        except CallbackUrlError as exc:  # allowed at creation but not any more (the settings changed)
            log.warning("callback for %s not sent: %s", batch.id, exc.message)
            return
        self._loop.call_soon_threadsafe(self._spawn, parsed, batch)

    def _spawn(self, url: httpx.URL, batch: BatchObject) -> None:
        assert self._client is not None
        task = asyncio.get_running_loop().create_task(deliver(self._client, url, batch, self.settings))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[DeliveryOutcome]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        outcome = task.result()
        level = logging.INFO if outcome.delivered else logging.WARNING
        log.log(
            level,
            "callback %s after %d attempt(s): %s",
            "delivered" if outcome.delivered else "failed",
            outcome.attempts,
            outcome.detail,
        )

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Give deliveries in flight ``timeout_s`` to finish, cancel the rest, close the client."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
        self._loop = None
