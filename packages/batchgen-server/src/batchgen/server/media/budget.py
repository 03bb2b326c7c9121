"""The pixels the server decodes at once. Each image counts the pixels its header claims, or what the model's
processor resizes it to where that is more; a request's images together stay within a budget of their own
(``--max-request-image-pixels``: over it, a 400), and every request's within the server's
(``--max-image-pixels-in-flight``): a request that would go over it is refused with a 429 (a batch line is tried
again once there is room, ``on_room``). A request's pixels are held from before its first image is decoded until the
model's processor is done with them; then the memory they took goes back to the system (glibc keeps what other
threads freed in their arenas until asked: RSS grew by 1 GB over four rounds of 6000 x 6000 pictures, and stayed)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import threading
from collections.abc import Callable, Iterator

from .errors import MediaError


class PixelBudget:
    def __init__(self, per_request: int, in_flight: int) -> None:
        """``per_request`` at most ``in_flight`` (``ServingConfig`` checks it): a request waiting for room gets it."""
        self.per_request = per_request
        self.in_flight = in_flight
        self.held_now = 0
        """Pixels held by requests being prepared."""
        self._lock = threading.Lock()
        self._waiting: list[Callable[[], None]] = []

    def check(self, pixels: int, param: str) -> None:
        """``MediaError`` (400) when one request's images are over the request's budget."""
        if pixels > self.per_request:
            raise MediaError(
                "too_many_image_pixels",
                f"The request's images have {pixels} pixels together (each its header's width x height, or what the "
                f"model's processor resizes it to where more); this server decodes at most {self.per_request} for "
                "one request (--max-request-image-pixels). Send fewer or smaller images.",
                param,
            )

    @contextlib.contextmanager
    def held(self, pixels: int, param: str) -> Iterator[None]:
        """Hold ``pixels`` of the server's budget while the block runs; a 429 ``MediaError`` when there is no room
        for them now."""
        self.check(pixels, param)
        with self._lock:
            if self.held_now + pixels > self.in_flight:
                raise MediaError(
                    "image_budget_full",
                    f"The server is decoding {self.held_now} pixels of images, of the {self.in_flight} it decodes at "
                    "once (--max-image-pixels-in-flight); retry shortly.",
                    param,
                    status_code=429,
                )
            self.held_now += pixels
        try:
            yield
        finally:
            with self._lock:
                self.held_now -= pixels
                waiting, self._waiting = self._waiting, []
            if pixels >= TRIM_FROM_PIXELS:
                give_back_memory()
            for call in waiting:
                call()

    def on_room(self, call: Callable[[], None]) -> None:
        """``call()`` once some pixels are given back (at once if none are held): a request refused for room tries
        again then."""
        with self._lock:
            if self.held_now:
                self._waiting.append(call)
                return
        call()


TRIM_FROM_PIXELS = 4_000_000
"""A request's pictures from this size give their memory back (a few ms to walk the arenas; smaller ones are
served from what is free)."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's (``None`` elsewhere: musl and macOS give freed pages back themselves); looked up on first use, as
    ``find_library`` runs ``ldconfig``."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


def give_back_memory() -> None:
    """The free memory of every malloc arena back to the system (a few ms for hundreds of MB)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
