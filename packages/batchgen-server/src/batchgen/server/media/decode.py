"""Image bytes -> an RGB picture, within the limits: bytes per image, pixels per image read from the header before
anything is decoded (a 1 KB PNG may claim 100,000 x 100,000: a decompression bomb), the formats taken (PNG, JPEG,
WebP, GIF's first frame). Pillow decodes."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

from PIL import Image

from .errors import MediaError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")

Image.MAX_IMAGE_PIXELS = None
"""Pillow's own bomb bound off: the server's (``max_image_pixels``) is checked on the header before anything is
decoded, and its refusal says the size."""


@dataclass(frozen=True, slots=True)
class MediaLimits:
    max_images: int = 8
    """Images one prompt may hold (``--limit-mm-per-prompt``)."""
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 40_000_000
    """Width x height, from the header, before decoding."""
    fetch_timeout_s: float = 10.0


def image_hash(data: bytes) -> bytes:
    """What the encoder cache and the prefix cache know an image by: its bytes' sha256."""
    return hashlib.sha256(data).digest()


def decode_image(data: bytes, param: str, limits: MediaLimits) -> Image.Image:
    """``data`` as an RGB picture; ``MediaError`` naming ``param`` when it is over a limit or not an image."""
    if len(data) > limits.max_image_bytes:
        raise MediaError(
            "image_too_large",
            f"The image is {len(data)} bytes; this server takes at most {limits.max_image_bytes} bytes an image.",
            param,
        )
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except Exception:  # Pillow's UnidentifiedImageError, or a header it cannot parse
        raise MediaError(
            "invalid_image", "The image is not a PNG, JPEG, WebP or GIF file that can be read.", param
        ) from None
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise _too_many_pixels((width, height), param, limits)
    try:
        image.seek(0)  # a GIF's (or an animated WebP's) first frame
        return image.convert("RGB")
    except Exception as exc:  # truncated or corrupt data past the header
        raise MediaError("invalid_image", f"The image could not be decoded: {exc}.", param) from None


def _too_many_pixels(size: tuple[int, int], param: str, limits: MediaLimits) -> MediaError:
    return MediaError(
        "image_too_large",
        f"The image claims {size[0]} x {size[1]} pixels; this server decodes at most {limits.max_image_pixels} "
        "pixels an image.",
        param,
    )
