"""A vision-language model's processor for images only, without torchvision: its image processor (Pillow backend),
its tokenizer and chat template, and the processor class's own expansion of image placeholders (``__call__``), with
no video processor (``AutoProcessor.from_pretrained`` loads one for Qwen2/2.5/3-VL, SmolVLM, Gemma 4... and the
video processors need torchvision). ``prompt_inputs`` turns a rendered prompt and its pictures into the token ids
and the ``MultimodalPrompt`` an engine request carries."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
from transformers.models.auto.processing_auto import (
    PROCESSOR_MAPPING_NAMES,
    processor_class_from_name,
)

from ..engine.features.multimodal.families import driven_family, runs
from ..engine.features.multimodal.prompt import ImageInput, MultimodalPrompt
from .kimi_k25 import KimiK25ImageProcessorPil
from .pixtral import PixtralPrompts

IMAGE_ONLY_ATTRIBUTES = ("image_processor", "tokenizer")

PILLOW_TWINS: dict[str, Any] = {"kimi_k25": KimiK25ImageProcessorPil}
"""Image processors transformers writes for torchvision alone, by model type: their Pillow twins, used where
torchvision is not installed."""


def _size_field(size: Any, name: str) -> Any:
    """A field of an image processor's ``size``: a ``SizeDict``, or a plain dict in older configs."""
    return size.get(name) if isinstance(size, dict) else getattr(size, name, None)


def _image_only(cls: type) -> type:
    """``cls`` accepting ``None`` for every sub-processor but the image processor and the tokenizer."""

    class ImageOnly(cls):  # type: ignore[misc]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and argument_name not in IMAGE_ONLY_ATTRIBUTES:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImageOnly.__name__ = ImageOnly.__qualname__ = f"ImageOnly{cls.__name__}"
    return ImageOnly


def _image_processor(path: str, model_type: str) -> Any:
    """The model's image processor: its Pillow backend, else its Pillow twin where torchvision is missing, else
    the one transformers has."""
    try:
        return AutoImageProcessor.from_pretrained(path, backend="pil")  # type: ignore[no-untyped-call, unused-ignore]  # typed from transformers 5.25
    except (ImportError, ValueError):
        pass
    if model_type in PILLOW_TWINS and importlib.util.find_spec("torchvision") is None:
        return PILLOW_TWINS[model_type].from_pretrained(path)
    return AutoImageProcessor.from_pretrained(path)  # type: ignore[no-untyped-call, unused-ignore]  # typed from transformers 5.25


class ImageProcessor:
    """What a served vision-language model makes prompts with: its processor (images only) and its family."""

    def __init__(self, path: str, tokenizer: Any, trust_remote_code: bool = False) -> None:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.family = driven_family(config, config.model_type)
        name = PROCESSOR_MAPPING_NAMES[config.model_type]
        image_processor = _image_processor(path, config.model_type)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
        self.processor: Any
        if name == "PixtralProcessor":  # transformers' needs torchvision: the same expansion without it
            self.processor = PixtralPrompts.from_pretrained(path, image_processor, tokenizer)
        else:
            cls = processor_class_from_name(name)
            processor_dict, kwargs = cls.get_processor_dict(path)
            pieces = {"image_processor": image_processor, "tokenizer": tokenizer}
            args = [pieces.get(name) for name in cls.get_attributes()]
            image_only: Any = _image_only(cls)
            self.processor = image_only.from_args_and_dict(args, processor_dict, **kwargs)
        self.image_token_id: int = config.image_token_id

    def processed_pixels(self, width: int, height: int) -> int:
        """The most pixels the image processor holds of a ``width`` x ``height`` picture: the picture's own, or what
        it resizes the picture to where that is more. Processors that scale the shortest side to a size (CLIP's,
        LLaVA-NeXT's base view) make a thin picture long; the others resize to a bounded size (a fixed one, a longest
        side, a budget of pixels or patches)."""
        image_processor = self.processor.image_processor
        size = getattr(image_processor, "size", None)
        shortest = _size_field(size, "shortest_edge")
        bounded = _size_field(size, "longest_edge") or _size_field(size, "max_pixels")
        if not getattr(image_processor, "do_resize", True) or not shortest or bounded:
            return width * height
        short, long = sorted((width, height))
        return max(width * height, int(shortest) * (int(shortest) * long // max(short, 1)))

    def prompt_inputs(self, text: str, images: list[Any], keys: list[bytes]) -> tuple[list[int], MultimodalPrompt]:
        """The token ids of ``text`` (a rendered chat with one image marker per picture) with each marker expanded
        to its image's placeholders, and the images as the engine request carries them."""
        out = self.processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
        ids: list[int] = out["input_ids"][0].tolist()
        positions = np.flatnonzero(np.asarray(ids) == self.image_token_id)
        counts = self.family.counts(out, len(images), positions, self.processor)
        if sum(counts) != len(positions) or len(counts) != len(images):
            raise ValueError(f"the prompt has {len(positions)} image placeholders for {sum(counts)} encoder rows")
        splits = np.split(positions, np.cumsum(counts)[:-1])
        pixels = self.family.split(out, counts, self.processor)
        items = tuple(ImageInput(key, where, pix) for key, where, pix in zip(keys, splits, pixels, strict=True))
        spans: tuple[tuple[int, int], ...] = ()
        if self.family.bidirectional:  # runs of placeholders, as transformers groups them (adjacent images: one)
            spans = tuple((int(run[0]), int(run[-1]) + 1) for run in runs(positions))
        return ids, MultimodalPrompt(items, self.family.extras(out), spans=spans)
