"""What each vision-language family's vision tower reads and gives, as the model's own ``forward`` does it: a
prompt's processor output split into each image's pixels and placeholder positions (``split``), a batch of images
(from any requests) through the model's own ``get_image_features`` (``encode``), and for M-RoPE models the prompt's
3-D positions from the model's own ``get_rope_index`` (``rope``). A family not listed here is refused at load."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


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


FAMILIES: dict[str, type[Family]] = {"llava": Family, "qwen2_5_vl": Qwen2_5VL}
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
    return family
