"""Where an image part's bytes come from: a ``data:`` URL (base64, checked strictly), an ``https://`` URL on a host
``--allowed-media-domains`` lists (through the completion callbacks' SSRF guard: no redirects, no proxies, a
timeout and a size cap), a ``file://`` path under ``--allowed-local-media-path`` (run-batch), or an upload named by
its file id. Called where requests are prepared, in worker threads: never on the event loop."""

from __future__ import annotations

import binascii
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from .decode import MediaLimits
from .errors import MediaError

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

    def url(self, url: str, param: str) -> bytes:
        if url.startswith("data:"):
            return self._data_url(url, param)
        if url.startswith("file://"):
            return self._local(url, param)
        if not self.allowed_domains:
            raise MediaError(
                "invalid_image_url",
                "Only data: URLs are taken here: this server fetches no remote images (the operator allows hosts "
                "with --allowed-media-domains).",
                param,
            )
        from ..callbacks import checked_url  # httpx: not imported by --help

        try:
            parsed = checked_url(url, self.allowed_domains, "image", schemes=("https",))
        except ValueError as exc:
            raise MediaError("invalid_image_url", str(exc), param) from None
        return self._fetch(parsed, param)

    def file(self, file_id: str, param: str) -> bytes:
        if self.files is None:
            raise MediaError("invalid_value", "Images by file_id need the server's file storage.", param)
        return self.files(file_id, param, self.limits.max_image_bytes)

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
                "file:// URLs are off (run-batch's --allowed-local-media-path allows a folder).",
                param,
            )
        path = Path(unquote(urlsplit(url).path)).resolve()
        if not path.is_relative_to(self.local_root) or not path.is_file():
            raise MediaError("invalid_image_url", f"No image at {url!r} under the allowed local media path.", param)
        if path.stat().st_size > self.limits.max_image_bytes:
            raise MediaError("image_too_large", f"The image is over {self.limits.max_image_bytes} bytes.", param)
        return path.read_bytes()

    def _fetch(self, url: object, param: str) -> bytes:
        import httpx

        cap = self.limits.max_image_bytes
        deadline = time.monotonic() + self.limits.fetch_timeout_s  # httpx's timeout is per read: a slow drip too
        try:
            client = httpx.Client(follow_redirects=False, trust_env=False, timeout=self.limits.fetch_timeout_s)
            with client, client.stream("GET", url) as response:  # type: ignore[arg-type]
                if response.status_code != 200:
                    raise MediaError(
                        "image_fetch_failed", f"Fetching the image answered HTTP {response.status_code}.", param
                    )
                data = bytearray()
                for chunk in response.iter_bytes():
                    data += chunk
                    if time.monotonic() > deadline:
                        raise MediaError(
                            "image_fetch_failed",
                            f"Fetching the image took over {self.limits.fetch_timeout_s:g} s.",
                            param,
                        )
                    if len(data) > cap:
                        raise MediaError(
                            "image_too_large", f"The image is over {cap} bytes, the most taken an image.", param
                        )
                return bytes(data)
        except httpx.HTTPError as exc:
            raise MediaError("image_fetch_failed", f"Fetching the image failed: {type(exc).__name__}.", param) from None
