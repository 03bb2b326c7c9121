"""Image bytes -> an RGB picture, within the limits: bytes per image, pixels per image and the aspect ratio read
from the header before anything is decoded (a 1 KB PNG may claim 100,000 x 100,000: a decompression bomb), the
formats taken (PNG, JPEG, WebP, GIF's first frame), a JPEG too short for its size refused (libjpeg would pad it out
with grey). Pillow decodes."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

from PIL import Image

from .errors import MediaError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_ASPECT_RATIO = 200
"""Longest side over shortest, as transformers' Qwen2-VL processor takes at most: past it, a processor that scales
the short side up to its tower's size makes millions of pixels out of a thin strip (1 x 400,000 became 56 x 22.4M)."""

Image.MAX_IMAGE_PIXELS = None
"""Pillow's own bomb bound off: the server's (``max_image_pixels``) is checked on the header before anything is
decoded, and its refusal says the size."""


@dataclass(frozen=True, slots=True)
class MediaLimits:
    max_images: int = 8
    """Images one prompt may hold (``--limit-mm-per-prompt``)."""
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 40_000_000
    """Width x height, from the header, before decoding; and what the model's processor resizes it to."""
    fetch_timeout_s: float = 10.0
    """The most a fetch of an image URL may take, from its first byte sent to its last received."""


def image_hash(data: bytes) -> bytes:
    """What the encoder cache and the prefix cache know an image by: its bytes' sha256."""
    return hashlib.sha256(data).digest()


def open_image(data: bytes, param: str, limits: MediaLimits) -> Image.Image:
    """``data``'s picture, its header read and checked against the limits (``MediaError`` naming ``param``); nothing
    decoded yet."""
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
        raise too_many_pixels(f"claims {width} x {height} pixels", param, limits)
    if max(width, height) > MAX_ASPECT_RATIO * max(min(width, height), 1):
        raise MediaError(
            "image_too_large",
            f"The image is {width} x {height} pixels; this server takes at most {MAX_ASPECT_RATIO}:1 between its "
            "longest and shortest sides.",
            param,
        )
    if image.format == "JPEG" and _short_jpeg(data, width, height):
        message = f"The JPEG holds too little data for its {width} x {height} pixels: it is cut short."
        raise MediaError("invalid_image", message, param)
    return image


def decoded(image: Image.Image, param: str) -> Image.Image:
    """``image`` (from ``open_image``) decoded, as RGB: its first frame, and no copy where it is RGB already."""
    try:
        image.seek(0)  # a GIF's (or an animated WebP's) first frame
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")
    except Exception as exc:  # truncated or corrupt data past the header
        raise MediaError("invalid_image", f"The image could not be decoded: {exc}.", param) from None


def too_many_pixels(what: str, param: str, limits: MediaLimits) -> MediaError:
    message = f"The image {what}; this server takes at most {limits.max_image_pixels} pixels an image."
    return MediaError("image_too_large", message, param)


_ARITHMETIC_FRAMES = (b"\xff\xc9", b"\xff\xca", b"\xff\xcb", b"\xff\xcd", b"\xff\xce", b"\xff\xcf")


def _short_jpeg(data: bytes, width: int, height: int) -> bool:
    """Fewer bytes after the first scan's start than one bit for each 8 x 8 block of its luma: Huffman coding spends
    at least that on each block's DC coefficient (a black 6000 x 6000 JPEG, optimized, spends two), so the file was
    cut short, and libjpeg would make up the rest in grey. Arithmetic-coded JPEGs, which can spend less, are not
    judged."""
    start = data.find(b"\xff\xda")
    if start < 0 or any(data.find(marker, 0, start) >= 0 for marker in _ARITHMETIC_FRAMES):
        return False
    blocks = -(-width // 8) * -(-height // 8)
    return (len(data) - start) * 8 < blocks
