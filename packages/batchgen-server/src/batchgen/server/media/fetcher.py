"""Image URLs fetched off every thread that serves requests: one event loop of its own (in a daemon thread) runs
every fetch, each within a total deadline (``--media-fetch-timeout-s``, from its first byte sent to its last byte
received: httpx's own timeouts are per read, and a host sending one byte every 4 s held a fetch for minutes), at most
``PER_TENANT`` at once for one tenant and ``AT_ONCE`` in all. Callers wait on a future: the online endpoints on the
event loop, holding no thread; the batch loop before a line is tokenized, so that a slow host holds back the lines
that name it and no other."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from .decode import MediaLimits
from .errors import MediaError

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("batchgen.server.media")

PER_TENANT = 8
"""Fetches of one tenant at once: its other fetches wait their turn (a batch line's deadline starts when its fetch
does; an online request waits for its pictures within the deadline, turn included)."""
AT_ONCE = 32
"""Fetches at once in all: a bound on the bytes in flight (each at most ``--max-image-bytes``)."""

Fetched = Mapping[str, "bytes | MediaError"]
"""Each URL a request names (as written) -> its bytes, or why there are none."""


class MediaFetcher:
    def __init__(self, limits: MediaLimits, check: Callable[[str, str], httpx.URL]) -> None:
        """``check``: the SSRF guard, ``(url, param)`` -> the URL to request, or a ``MediaError``."""
        self.limits = limits
        self.check = check
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._started = threading.Lock()
        self._tenants: dict[str, asyncio.Semaphore] = {}
        """Only touched on the fetcher's loop."""
        self._all: asyncio.Semaphore | None = None

    def fetch(self, urls: Sequence[tuple[str, str]], owner: str) -> Future[Fetched]:
        """Fetch each ``(url, the field naming it)``, all at once, for ``owner``'s request: their bytes, or each
        one's ``MediaError``."""
        return asyncio.run_coroutine_threadsafe(self._fetch_all(urls, owner), self._running_loop())

    def close(self) -> None:
        """Its connections closed and its loop stopped, then closed, on the loop's own thread (a server's shutdown
        waits for neither); fetching again starts them anew."""
        with self._started:
            loop, self._loop = self._loop, None
            client, self._client = self._client, None
        if loop is not None:
            asyncio.run_coroutine_threadsafe(_shut_down(client, loop), loop)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._started:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._tenants, self._all = {}, None  # the last loop's semaphores are no use on this one
                threading.Thread(target=_serve, args=(self._loop,), name="batchgen-media", daemon=True).start()
            return self._loop

    async def _fetch_all(self, urls: Sequence[tuple[str, str]], owner: str) -> Fetched:
        results = await asyncio.gather(*(self._fetch_one(url, param, owner) for url, param in urls))
        return {url: result for (url, _), result in zip(urls, results, strict=True)}

    async def _fetch_one(self, written: str, param: str, owner: str) -> bytes | MediaError:
        import httpx

        try:
            url = self.check(written, param)
        except MediaError as exc:
            return exc
        timeout_s = self.limits.fetch_timeout_s
        async with self._place(owner):
            try:
                async with asyncio.timeout(timeout_s):
                    return await self._get(url, param)
            except TimeoutError:
                return MediaError("image_fetch_failed", f"Fetching the image took over {timeout_s:g} s.", param)
            except MediaError as exc:
                return exc
            except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError, OSError) as exc:
                return MediaError("image_fetch_failed", f"Fetching the image failed: {type(exc).__name__}.", param)
            except Exception as exc:  # a bug: this picture's failure, never a request left unanswered
                log.exception("fetching an image failed", exc_info=exc)
                return MediaError("image_fetch_failed", "Fetching the image failed.", param)

    async def _get(self, url: httpx.URL, param: str) -> bytes:
        cap = self.limits.max_image_bytes
        async with self._http().stream("GET", url) as response:
            if response.status_code != 200:
                raise MediaError(
                    "image_fetch_failed", f"Fetching the image answered HTTP {response.status_code}.", param
                )
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > cap:
                    message = f"The image is over {cap} bytes, the most taken an image."
                    raise MediaError("image_too_large", message, param)
            return bytes(data)

    @contextlib.asynccontextmanager
    async def _place(self, owner: str) -> AsyncIterator[None]:
        tenant = self._tenants.setdefault(owner, asyncio.Semaphore(PER_TENANT))
        if self._all is None:
            self._all = asyncio.Semaphore(AT_ONCE)
        async with tenant, self._all:
            yield

    def _http(self) -> httpx.AsyncClient:
        """No redirects followed (the SSRF guard checked this URL, not where it would lead), no proxies from the
        environment; the system's trust store (``SSL_CERT_FILE`` honoured) beside certifi's."""
        import certifi
        import httpx

        if self._client is None:
            trusted = ssl.create_default_context(cafile=certifi.where())
            trusted.load_default_certs()
            self._client = httpx.AsyncClient(
                follow_redirects=False,
                trust_env=False,
                verify=trusted,
                timeout=self.limits.fetch_timeout_s,
                limits=httpx.Limits(max_connections=AT_ONCE),
            )
        return self._client


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.run_forever()
    finally:
        loop.close()


async def _shut_down(client: httpx.AsyncClient | None, loop: asyncio.AbstractEventLoop) -> None:
    try:
        if client is not None:
            await client.aclose()
    finally:
        loop.stop()
