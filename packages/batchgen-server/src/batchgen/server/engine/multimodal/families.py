"""What each vision-language family's vision tower reads and gives, as the model's own ``forward`` does it: a
prompt's processor output split into each image's pixels and placeholder positions (``split``), a batch of images
(from any requests) through the model's own ``get_image_features`` (``encode``), and for M-RoPE models the prompt's
3-D positions from the model's own ``get_rope_index`` (``rope``). A family not listed here is refused at load."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


class Family:
    """LLaVA's shape, which most follow: one ``pixel_values`` row per image, every image the same number of
    placeholder tokens."""

    name = "LLaVA"
    mrope = False

    def counts(self, out: Mapping[str, Any], num_images: int, num_placeholders: int) -> list[int]:
        """How many placeholder tokens (encoder output rows) each image takes."""
        return [num_placeholders // num_images] * num_images

    def split(self, out: Mapping[str, Any], num_images: int) -> list[dict[str, Any]]:
        return [{"pixel_values": out["pixel_values"][i : i + 1]} for i in range(num_images)]

    def extras(self, out: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    @torch.no_grad()
    def encode(self, model: Any, images: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        """One ``[rows, hidden]`` tensor per image: the rows its placeholders take, as the model computes them."""
        pixels = torch.cat([image["pixel_values"] for image in images]).to(model.device, model.dtype)
        return list(model.model.get_image_features(pixel_values=pixels).pooler_output)

    def rope(self, model: Any, prompt: list[int], mm: Any) -> tuple[np.ndarray, int]:
        raise NotImplementedError


class Mistral3(Family):
    """Mistral 3 / Pixtral: each image its own size (``image_sizes``), padded in a batch; the vision tower crops
    each image back to its size, so padding them to the batch's largest changes nothing."""

    name = "Mistral 3"

    def counts(self, out: Mapping[str, Any], num_images: int, num_placeholders: int) -> list[int]:
        sizes = out["image_sizes"].tolist()
        patch = self._patch * self._merge
        return [(h // patch) * (w // patch) for h, w in sizes]

    def split(self, out: Mapping[str, Any], num_images: int) -> list[dict[str, Any]]:
        images = []
        for i, (h, w) in enumerate(out["image_sizes"].tolist()):
            images.append(
                {
                    "pixel_values": out["pixel_values"][i : i + 1, :, :h, :w],
                    "image_sizes": out["image_sizes"][i : i + 1],
                }
            )
        return images

    @torch.no_grad()
    def encode(self, model: Any, images: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        height = max(image["pixel_values"].shape[-2] for image in images)
        width = max(image["pixel_values"].shape[-1] for image in images)
        pixels = torch.cat(
            [
                F.pad(
                    image["pixel_values"],
                    (0, width - image["pixel_values"].shape[-1], 0, height - image["pixel_values"].shape[-2]),
                )
                for image in images
            ]
        ).to(model.device, model.dtype)
        sizes = torch.cat([image["image_sizes"] for image in images]).to(model.device)
        return list(model.model.get_image_features(pixel_values=pixels, image_sizes=sizes).pooler_output)

    _patch = 14
    _merge = 2


class Qwen2_5VL(Family):
    """Qwen2.5-VL: dynamic resolution (each image its grid of patches, all images' patches in one sequence through
    the vision tower) and M-RoPE positions."""

    name = "Qwen2.5-VL"
    mrope = True

    def counts(self, out: Mapping[str, Any], num_images: int, num_placeholders: int) -> list[int]:
        merge = self._merge_size
        return [int(t * h * w) // merge**2 for t, h, w in out["image_grid_thw"].tolist()]

    def split(self, out: Mapping[str, Any], num_images: int) -> list[dict[str, Any]]:
        grids = out["image_grid_thw"]
        rows = np.cumsum([0, *(int(g.prod()) for g in grids)])
        return [
            {"pixel_values": out["pixel_values"][rows[i] : rows[i + 1]], "image_grid_thw": grids[i : i + 1]}
            for i in range(num_images)
        ]

    def extras(self, out: Mapping[str, Any]) -> dict[str, Any]:
        return {"mm_token_type_ids": out["mm_token_type_ids"]}

    @torch.no_grad()
    def encode(self, model: Any, images: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        pixels = torch.cat([image["pixel_values"] for image in images]).to(model.device)
        grids = torch.cat([image["image_grid_thw"] for image in images]).to(model.device)
        return list(model.model.get_image_features(pixels, grids).pooler_output)

    @torch.no_grad()
    def rope(self, model: Any, prompt: list[int], mm: Any) -> tuple[np.ndarray, int]:
        grids = torch.cat([image.pixels["image_grid_thw"] for image in mm.images])
        positions, delta = model.model.get_rope_index(
            torch.tensor([prompt]), mm.extras["mm_token_type_ids"], image_grid_thw=grids
        )
        return positions[:, 0].cpu().numpy(), int(delta.reshape(-1)[0])

    _merge_size = 2


FAMILIES: dict[str, type[Family]] = {"llava": Family, "mistral3": Mistral3, "qwen2_5_vl": Qwen2_5VL}
"""The families the engine drives exactly (tests/engine/test_images.py checks each against ``generate``)."""


def family_of(config: Any) -> Family | None:
    """The family of a vision-language model's config (``None``: not one the engine drives)."""
    cls = FAMILIES.get(config.model_type)
    if cls is None:
        return None
    family = cls()
    vision: Any = config.vision_config
    if isinstance(family, Qwen2_5VL):
        family._merge_size = vision.spatial_merge_size
    if isinstance(family, Mistral3):
        family._patch, family._merge = vision.patch_size, config.spatial_merge_size
    return family
