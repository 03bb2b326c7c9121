"""Pixtral's prompt (Mistral 3 and Pixtral checkpoints) without torchvision: transformers marks ``PixtralProcessor``
as needing it (its module imports the torchvision image processor for one resize helper), though what a prompt needs
is the Pillow image processor and the tokenizer. This is ``PixtralProcessor.__call__`` for images, as transformers
5.24 writes it: the pictures resized to multiples of ``patch_size * spatial_merge_size``, and each ``[IMG]`` marker
replaced by the picture's rows of ``[IMG]`` tokens, each row ending in ``[IMG_BREAK]``, the last in ``[IMG_END]``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import BatchFeature
from transformers.utils.hub import cached_file


class PixtralPrompts:
    def __init__(self, image_processor: Any, tokenizer: Any, settings: dict[str, Any]) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.patch_size: int = settings.get("patch_size", 16)
        self.spatial_merge_size: int = settings.get("spatial_merge_size", 1)
        self.image_token: str = settings.get("image_token", "[IMG]")
        self.image_break_token: str = settings.get("image_break_token", "[IMG_BREAK]")
        self.image_end_token: str = settings.get("image_end_token", "[IMG_END]")
        self.image_token_id: int = tokenizer.convert_tokens_to_ids(self.image_token)

    @classmethod
    def from_pretrained(cls, path: str, image_processor: Any, tokenizer: Any) -> PixtralPrompts:
        found = Path(path) / "processor_config.json"
        if not found.is_file():
            found = Path(cached_file(path, "processor_config.json", _raise_exceptions_for_missing_entries=False) or "")
        settings = json.loads(found.read_text()) if found.is_file() else {}
        return cls(image_processor, tokenizer, settings)

    def __call__(self, text: list[str], images: list[Any], return_tensors: str = "pt", **kwargs: Any) -> BatchFeature:
        patch = self.patch_size * self.spatial_merge_size
        pixels = self.image_processor(images, patch_size=patch, return_tensors=return_tensors)
        pieces = text[0].split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt has {len(pieces) - 1} image markers for {len(images)} images")
        out = [pieces[0]]
        for (height, width), piece in zip(pixels["image_sizes"].tolist(), pieces[1:], strict=True):
            rows = [self.image_token * (width // patch) + self.image_break_token] * (height // patch)
            out += ["".join(rows)[: -len(self.image_break_token)] + self.image_end_token, piece]
        tokens = self.tokenizer(["".join(out)], return_tensors=return_tensors, **kwargs)
        return BatchFeature({**tokens, **pixels})
