"""Images in requests: where a part's bytes come from (``sources``: data URLs, allowed https hosts, uploads by
file id, run-batch's local paths) and how they become a picture within the limits (``decode``)."""

from .decode import MediaLimits, decode_image, image_hash
from .errors import MediaError
from .sources import ImageSources

__all__ = ["ImageSources", "MediaError", "MediaLimits", "decode_image", "image_hash"]
