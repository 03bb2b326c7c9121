"""A chat's images made ready: each image part's bytes fetched (``media.ImageSources``), their headers checked
against the limits (what the model's processor will resize them to included), their pixels held within the budget
(``media.PixelBudget``) while they are decoded and go through the model's processor: the token ids with each image's
placeholders, and the ``MultimodalPrompt`` the engine request carries. Every refusal names its part
(``messages[0].content[1]``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchgen.schemas import ChatCompletionRequest, FileContentPart, ImageContentPart, ResponseRequest

from ..media import ImageSources, MediaError, MediaLimits, PixelBudget, decoded, image_hash, open_image
from ..media.decode import too_many_pixels
from ..media.fetcher import Fetched
from .errors import RequestRejected

if TYPE_CHECKING:
    from ..engine.features.multimodal.prompt import MultimodalPrompt
    from .image_processor import ImageProcessor


def image_parts(body: ChatCompletionRequest) -> list[tuple[str, ImageContentPart | FileContentPart]]:
    """The image parts of a chat, in prompt order, each with its field's name."""
    parts: list[tuple[str, ImageContentPart | FileContentPart]] = []
    for m, message in enumerate(body.messages):
        if isinstance(message.content, list):
            for p, part in enumerate(message.content):
                if isinstance(part, ImageContentPart | FileContentPart):
                    parts.append((f"messages[{m}].content[{p}]", part))
    return parts


def part_urls(parts: list[tuple[str, ImageContentPart | FileContentPart]]) -> list[tuple[str, str]]:
    """The URLs of the image parts that name one, each with its field's name."""
    return [
        (part.image_url.url, f"{param}.image_url.url") for param, part in parts if isinstance(part, ImageContentPart)
    ]


def response_images(body: ResponseRequest) -> tuple[int, list[tuple[str, str]]]:
    """How many ``input_image`` parts a response request has, and the URLs they name, each with its field."""
    if isinstance(body.input, str):
        return 0, []
    parts = [
        (part, f"input[{i}].content[{p}]")
        for i, item in enumerate(body.input)
        if isinstance(item.content, list)
        for p, part in enumerate(item.content)
        if part.type == "input_image"
    ]
    return len(parts), [(part.image_url, f"{param}.image_url") for part, param in parts if part.image_url is not None]


class ImagePrompter:
    def __init__(self, processor: ImageProcessor | None, sources: ImageSources, budget: PixelBudget) -> None:
        self.processor = processor
        """The served model's (``None``: a text-only model, which refuses image parts)."""
        self.sources = sources
        self.budget = budget

    @property
    def limits(self) -> MediaLimits:
        return self.sources.limits

    def check(self, body: ChatCompletionRequest, model: str) -> list[tuple[str, ImageContentPart | FileContentPart]]:
        """The chat's image parts, once the served model and the limits take them."""
        parts = image_parts(body)
        if parts and self.processor is None:
            raise RequestRejected(
                "unsupported_content",
                f"model {model!r} reads text only: it cannot take an image part",
                parts[0][0],
            )
        if len(parts) > self.limits.max_images:
            raise RequestRejected(
                "too_many_images",
                f"The prompt has {len(parts)} images; this server takes at most {self.limits.max_images} a prompt "
                "(--limit-mm-per-prompt).",
                parts[self.limits.max_images][0],
            )
        return parts

    def prompt(
        self,
        text: str,
        parts: list[tuple[str, ImageContentPart | FileContentPart]],
        *,
        fetched: Fetched | None,
    ) -> tuple[list[int], MultimodalPrompt]:
        """``text`` (the chat rendered, one image marker per part) as token ids with its pictures; ``fetched``: the
        remote images fetched for it already. No room in the server's pixel budget now is a 429."""
        assert self.processor is not None
        try:
            images, keys, pixels = [], [], 0
            for param, part in parts:
                data, field = self._bytes(param, part, fetched)
                keys.append(image_hash(data))
                images.append((open_image(data, field, self.limits), field))
                pixels += self._processed_pixels(*images[-1])
            with self.budget.held(pixels, "messages"):
                pictures: list[Any] = []
                try:
                    while images:  # each original goes as its RGB picture comes (a converted one is a copy)
                        pictures.append(decoded(*images.pop(0)))
                    return self._processed(text, pictures, keys)
                finally:  # no picture outlives the budget, which gives their memory back
                    images.clear()
                    pictures.clear()
        except MediaError as exc:
            raise RequestRejected(exc.code, exc.message, exc.param, status_code=exc.status_code) from None

    def _processed_pixels(self, image: Any, field: str) -> int:
        """What the model's processor resizes ``image`` to, within the limit for one image."""
        assert self.processor is not None
        processed = self.processor.processed_pixels(*image.size)
        if processed > self.limits.max_image_pixels:
            width, height = image.size
            resized = f"({width} x {height}) would be {processed} pixels once the model's processor resizes it"
            raise too_many_pixels(resized, field, self.limits)
        return processed

    def _processed(self, text: str, pictures: list[Any], keys: list[bytes]) -> tuple[list[int], MultimodalPrompt]:
        assert self.processor is not None
        try:
            return self.processor.prompt_inputs(text, pictures, keys)
        except (ValueError, TypeError) as exc:  # the processor's own refusals (a picture too small for it...)
            raise RequestRejected(
                "invalid_image", f"The model's processor refused the images: {exc}", "messages"
            ) from None

    def _bytes(
        self, param: str, part: ImageContentPart | FileContentPart, fetched: Fetched | None
    ) -> tuple[bytes, str]:
        """The part's bytes, and the field that gave them (what a refusal names)."""
        if isinstance(part, ImageContentPart):
            field = f"{param}.image_url.url"
            return self.sources.url(part.image_url.url, field, fetched), field
        ref = part.file
        if ref.file_id is not None:
            field = f"{param}.file.file_id"
            return self.sources.file(ref.file_id, field), field
        if ref.file_data is not None:
            data, field = ref.file_data, f"{param}.file.file_data"
            if not data.startswith("data:"):  # OpenAI's file_data may be the base64 alone
                data = "data:image/unknown;base64," + data
            return self.sources.url(data, field), field
        raise MediaError("invalid_value", "A file part needs a file_id or file_data.", f"{param}.file")


def media_of(config: Any, processor: ImageProcessor | None = None) -> ImagePrompter:
    """The images a ``ServingConfig`` allows, through the served model's ``processor`` (``None``: a text model)."""
    limits = MediaLimits(
        max_images=config.max_images,
        max_image_bytes=config.max_image_bytes,
        max_image_pixels=config.max_image_pixels,
        fetch_timeout_s=config.media_fetch_timeout_s,
    )
    sources = ImageSources(limits, config.allowed_media_domains, config.allowed_local_media_path)
    budget = PixelBudget(config.max_request_image_pixels, config.max_image_pixels_in_flight)
    return ImagePrompter(processor, sources, budget)


def image_processor_for(config: Any, tokenizer: Any) -> ImageProcessor | None:
    """The processor of a served vision-language model (``EngineConfig``); ``None`` for a text model."""
    from transformers import AutoConfig

    from ..engine.loading.loader import is_vision_language, resolve_model_path
    from .image_processor import ImageProcessor

    path = resolve_model_path(config.model)
    model_config = AutoConfig.from_pretrained(
        path, revision=config.revision, trust_remote_code=config.trust_remote_code
    )
    if not is_vision_language(model_config):
        return None
    return ImageProcessor(path, tokenizer, config.trust_remote_code)
