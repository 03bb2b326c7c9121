"""Images in requests: where a part's bytes come from (``sources``: data URLs, allowed https hosts fetched by
``fetcher``, uploads by file id, run-batch's local paths), how they become a picture within the limits (``decode``),
and how many pixels are decoded at once (``budget``)."""

from .budget import PixelBudget
from .decode import MediaLimits, decoded, image_hash, open_image
from .errors import MediaError
from .sources import ImageSources

__all__ = [
    "ImageSources",
    "MediaError",
    "MediaLimits",
    "PixelBudget",
    "decoded",
    "image_hash",
    "open_image",
]
