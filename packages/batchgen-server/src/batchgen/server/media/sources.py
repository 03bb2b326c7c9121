"""Where an image part's bytes come from: a ``data:`` URL (base64, checked strictly), an ``https://`` URL on a host
``--allowed-media-domains`` lists (through the completion callbacks' SSRF guard: no redirects, no proxies, a total
deadline and a size cap; fetched by ``MediaFetcher``, before the request is prepared where the caller can), a
``file://`` path under ``--allowed-local-media-path`` (run-batch; ``serve`` only with ``--serve-local-media``), or an
upload named by its file id. Called where requests are prepared, in worker threads: never on the event loop."""

from __future__ import annotations

import binascii
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from .decode import MediaLimits
from .errors import MediaError
from .fetcher import Fetched, MediaFetcher

if TYPE_CHECKING:
    from concurrent.futures import Future

    import httpx

FileReader = Callable[[str, str, int], bytes]
"""``(file_id, param, max_bytes)`` -> the upload's bytes; ``MediaError`` when the caller may not read it."""


class ImageSources:
    def __init__(
        self,
        limits: MediaLimits,
        allowed_domains: tuple[str, ...] = (),
        local_root: str | None = None,
        files: FileReader | None = None,
    ) -> None:
        self.limits = limits
        self.allowed_domains = allowed_domains
        self.local_root = Path(local_root).resolve() if local_root else None
        self.files = files
        """Uploads by id (the server's storage; run-batch has none)."""
        self.fetcher = MediaFetcher(limits, self._checked)

    def url(self, url: str, param: str, fetched: Fetched | None = None) -> bytes:
        """The bytes ``url`` names; ``fetched``: what ``fetch`` got for the request already (a remote URL not in it
        is fetched now, waiting for it)."""
        if url.startswith("data:"):
            return self._data_url(url, param)
        if url.startswith("file://"):
            return self._local(url, param)
        if fetched is None or url not in fetched:  # not fetched ahead (run-batch, a direct caller): now
            self._checked(url, param)  # a refusal needs no fetcher's loop started
            fetched = self.fetch([(url, param)], owner="").result()
        result = fetched[url]
        if isinstance(result, MediaError):
            raise result
        return result

    def remote(self, urls: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """The ``(url, param)`` pairs to fetch over the network: none where no host is allowed (each is refused as
        the request is prepared)."""
        if not self.allowed_domains:
            return []
        remote: dict[str, str] = {}
        for url, param in urls:
            if not url.startswith(("data:", "file://")):
                remote.setdefault(url, param)  # each URL once, named by its first part
        return list(remote.items())

    def fetch(self, urls: list[tuple[str, str]], owner: str) -> Future[Fetched]:
        """Each remote ``(url, param)``'s bytes (or its ``MediaError``), fetched at once for ``owner``'s request on
        the fetcher's own loop."""
        return self.fetcher.fetch(urls, owner)

    def file(self, file_id: str, param: str) -> bytes:
        if self.files is None:
            raise MediaError("invalid_value", "Images by file_id need the server's file storage.", param)
        return self.files(file_id, param, self.limits.max_image_bytes)

    def _checked(self, url: str, param: str) -> httpx.URL:
        if not self.allowed_domains:
            raise MediaError(
                "invalid_image_url",
                "Only data: URLs are taken here: this server fetches no remote images (the operator allows hosts "
                "with --allowed-media-domains).",
                param,
            )
        from ..callbacks import checked_url  # httpx: not imported by --help

        try:
            return checked_url(url, self.allowed_domains, "image", schemes=("https",))
        except ValueError as exc:
            raise MediaError("invalid_image_url", str(exc), param) from None

    def _data_url(self, url: str, param: str) -> bytes:
        head, comma, payload = url.partition(",")
        if not comma or not head.endswith(";base64") or not head[5:].startswith("image/"):
            raise MediaError("invalid_image_url", "A data URL must read data:image/<format>;base64,<data>.", param)
        # Refused before decoding: base64 is 4 characters for 3 bytes.
        if len(payload) // 4 * 3 > self.limits.max_image_bytes + 3:
            raise MediaError(
                "image_too_large",
                f"The image is over {self.limits.max_image_bytes} bytes, the most this server takes an image.",
                param,
            )
        try:
            return binascii.a2b_base64(payload, strict_mode=True)
        except binascii.Error as exc:
            raise MediaError("invalid_image", f"The data URL's base64 is not valid: {exc}.", param) from None

    def _local(self, url: str, param: str) -> bytes:
        if self.local_root is None:
            raise MediaError(
                "invalid_image_url",
                "file:// URLs are off here (run-batch's --allowed-local-media-path allows a folder; a server's "
                "callers also need --serve-local-media).",
                param,
            )
        try:
            path = Path(unquote(urlsplit(url).path)).resolve()
            found = path.is_relative_to(self.local_root) and path.is_file()
        except (ValueError, OSError):  # an embedded NUL (%00), a name too long...
            found = False
        if not found:
            raise MediaError("invalid_image_url", f"No image at {url!r} under the allowed local media path.", param)
        if path.stat().st_size > self.limits.max_image_bytes:
            raise MediaError("image_too_large", f"The image is over {self.limits.max_image_bytes} bytes.", param)
        return path.read_bytes()
