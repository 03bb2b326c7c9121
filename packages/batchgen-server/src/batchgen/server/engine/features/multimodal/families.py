"""What each vision-language family's vision tower reads and gives, as the model's own ``forward`` does it: a
prompt's processor output split into each image's pixels and placeholder positions (``split``), a batch of images
(from any requests) through the model's own ``get_image_features`` (``encode``), and for M-RoPE models the prompt's
3-D positions from the model's own ``get_rope_index`` (``rope``). A family not listed here is refused at load."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, PretrainedConfig

from ...config import EngineConfig
from ...errors import ModelNotSupported
from ...loading.loader import is_vision_language, resolve_model_path


class Family:
    """LLaVA's shape, which most follow: one ``pixel_values`` row per image, every image the same number of
    placeholder tokens."""

    name = "LLaVA"
    mrope = False
    bidirectional = False
    """Image tokens attend to each other both ways (Gemma 3): prefill chunks keep each run of them whole, and their
    attention sees the whole run (``MultimodalPrompt.spans``)."""
    sliding_only = False
    """... on sliding-window layers only (Gemma 4)."""
    split_problem: str | None = None
    """Why its model cannot run split over ranks (``None``: it can)."""

    def counts(self, out: Mapping[str, Any], num_images: int, positions: np.ndarray, processor: Any) -> list[int]:
        """How many placeholder tokens (encoder output rows) each image takes (``positions``: the prompt's
        placeholders)."""
        return [len(positions) // num_images] * num_images

    def split(self, out: Mapping[str, Any], counts: list[int], processor: Any) -> list[dict[str, Any]]:
        """Each image's own pixels (``counts``: its placeholders)."""
        return [{"pixel_values": out["pixel_values"][i : i + 1]} for i in range(len(counts))]

    def extras(self, out: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    @torch.no_grad()
    def encode(self, model: Any, images: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        """One ``[rows, hidden]`` tensor per image: the rows its placeholders take, as the model computes them."""
        pixels = torch.cat([image["pixel_values"] for image in images]).to(model.device, model.dtype)
        return list(model.model.get_image_features(pixel_values=pixels).pooler_output)

    def rope(self, model: Any, prompt: list[int], mm: Any) -> tuple[np.ndarray, int]:
        raise NotImplementedError

    def forward_kwargs(
        self, model: Any, input_ids: torch.Tensor, rows: torch.Tensor, features: torch.Tensor, embeds: torch.Tensor
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """What the model's ``forward`` hands its base model and its language model besides the embeddings, for a
        step whose packed ``rows`` hold the image ``features`` (``VisionStep.assemble``)."""
        return None, None


class Qwen2_5VL(Family):
    """Qwen2.5-VL: dynamic resolution (each image its grid of patches, all images' patches in one sequence through
    the vision tower) and M-RoPE positions."""

    name = "Qwen2.5-VL"
    mrope = True

    def counts(self, out: Mapping[str, Any], num_images: int, positions: np.ndarray, processor: Any) -> list[int]:
        return [int(t * h * w) // self._merged for t, h, w in out["image_grid_thw"].tolist()]

    def split(self, out: Mapping[str, Any], counts: list[int], processor: Any) -> list[dict[str, Any]]:
        grids = out["image_grid_thw"]
        rows = np.cumsum([0, *(int(g.prod()) for g in grids)])
        return [
            {"pixel_values": out["pixel_values"][rows[i] : rows[i + 1]], "image_grid_thw": grids[i : i + 1]}
            for i in range(len(counts))
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

    _merged = 4
    """Patches merged into one placeholder (the tower's merge window)."""


class KimiK25(Qwen2_5VL):
    """Kimi K2.5 (MoonViT, DeepSeek-V3's text model: MLA and experts): Qwen2.5-VL's grids of patches, each
    picture's merged in windows (``merge_kernel_size``), at the text model's plain positions."""

    name = "Kimi K2.5"
    mrope = False

    def extras(self, out: Mapping[str, Any]) -> dict[str, Any]:
        return {}


class Idefics3(Family):
    """Idefics3 and SmolVLM: each picture split into tiles plus a global view, each tile its run of
    placeholders; an image's tiles end with the run after its ``<global-img>`` token."""

    name = "Idefics3"

    def counts(self, out: Mapping[str, Any], num_images: int, positions: np.ndarray, processor: Any) -> list[int]:
        ids = out["input_ids"][0].numpy()
        global_id = getattr(processor, "global_image_token_id", None)  # Idefics3's; SmolVLM names only the token
        if global_id is None:
            global_id = processor.tokenizer.convert_tokens_to_ids(processor.global_image_token)
        ends = np.flatnonzero(ids == global_id) + processor.image_seq_len  # each image's last
        counts: list[int] = np.diff(np.searchsorted(positions, ends, side="right"), prepend=0).tolist()
        return counts

    def split(self, out: Mapping[str, Any], counts: list[int], processor: Any) -> list[dict[str, Any]]:
        images, start = [], 0
        for count in counts:
            tiles = count // processor.image_seq_len
            end = start + tiles
            images.append({
                "pixel_values": out["pixel_values"][0, start:end],
                "pixel_attention_mask": out["pixel_attention_mask"][0, start:end],
            })  # fmt: skip
            start = end
        return images

    @torch.no_grad()
    def encode(self, model: Any, images: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        """Each image a batch row, its tiles padded with zero tiles (which the model drops, as it does its own
        padding), so its output is its row."""
        most = max(image["pixel_values"].shape[0] for image in images)

        def padded(tensor: torch.Tensor) -> torch.Tensor:
            return torch.cat([tensor, tensor.new_zeros(most - tensor.shape[0], *tensor.shape[1:])])

        pixels = torch.stack([padded(image["pixel_values"]) for image in images]).to(model.device)
        masks = torch.stack([padded(image["pixel_attention_mask"]) for image in images]).to(model.device)
        return list(model.model.get_image_features(pixel_values=pixels, pixel_attention_mask=masks).pooler_output)


class LlavaNext(Family):
    """LLaVA-NeXT ("anyres"): each picture a grid of tiles plus a base view (``pixel_values`` padded to the prompt's
    most tiles), its placeholders as many as the processor's own expansion gives for its size; the model's
    ``get_image_features`` packs each picture's rows itself (grid unpadded to the picture's aspect ratio, an
    ``image_newline`` ending each row, after the base view's rows)."""

    name = "LLaVA-NeXT"

    def counts(self, out: Mapping[str, Any], num_images: int, positions: np.ndarray, processor: Any) -> list[int]:
        return [len(processor.replace_image_token(out, i)) // len(processor.image_token) for i in range(num_images)]

    def split(self, out: Mapping[str, Any], counts: list[int], processor: Any) -> list[dict[str, Any]]:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        tile = out["pixel_values"].shape[-1]  # the tower's image size, which the model tiles by
        pinpoints = processor.image_processor.image_grid_pinpoints
        return [
            {
                "pixel_values": out["pixel_values"][i, : image_size_to_num_patches(size, pinpoints, tile)],
                "image_sizes": out["image_sizes"][i : i + 1],
            }
            for i, size in enumerate(out["image_sizes"].tolist())
        ]

    @torch.no_grad()
    def encode(self, model: Any, images: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        """The pictures' tiles padded to the most tiles (the model slices each picture's own back by its size)."""
        most = max(image["pixel_values"].shape[0] for image in images)
        pixels = torch.stack([
            torch.cat([image["pixel_values"], image["pixel_values"].new_zeros(most - image["pixel_values"].shape[0],
                                                                              *image["pixel_values"].shape[1:])])
            for image in images
        ]).to(model.device, model.dtype)  # fmt: skip
        sizes = torch.cat([image["image_sizes"] for image in images]).to(model.device)
        return list(
            model.model.get_image_features(pixel_values=pixels, image_sizes=sizes, **self._kwargs(images)).pooler_output
        )

    def _kwargs(self, images: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return {}


class LlavaOnevision(LlavaNext):
    """LLaVA-OneVision: LLaVA-NeXT's anyres, its grid's features pooled down past ``vision_aspect_ratio``. The
    processor is handed a prompt's pictures as one flat list, which it (and ``generate`` on the same call) tiles
    each as a single image (``batch_num_images`` all ones), so each picture's rows are its own."""

    name = "LLaVA-OneVision"

    def split(self, out: Mapping[str, Any], counts: list[int], processor: Any) -> list[dict[str, Any]]:
        if any(int(n) != 1 for n in out["batch_num_images"]):  # prompt_inputs passes a flat list: never
            raise ValueError("LLaVA-OneVision's multi-image layout (untiled pictures) is not driven")
        return super().split(out, counts, processor)

    def _kwargs(self, images: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return {"batch_num_images": torch.ones(len(images), dtype=torch.long)}


class Qwen3VL(Qwen2_5VL):
    """Qwen3-VL: Qwen2.5-VL's grids and M-RoPE, plus deepstack features (one ``[rows, hidden]`` per layer), which
    each image's encoder output carries after its embedding columns and the language model adds to its first
    decoder layers' outputs at the image's positions."""

    name = "Qwen3-VL"

    @torch.no_grad()
    def encode(self, model: Any, images: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        pixels = torch.cat([image["pixel_values"] for image in images]).to(model.device)
        grids = torch.cat([image["image_grid_thw"] for image in images]).to(model.device)
        out = model.model.get_image_features(pixels, grids)
        # Each image's rows: its embeddings, then its deepstack features layer by layer, side by side.
        return [torch.cat(rows, dim=-1) for rows in zip(out.pooler_output, *out.deepstack_features, strict=True)]

    def forward_kwargs(
        self, model: Any, input_ids: torch.Tensor, rows: torch.Tensor, features: torch.Tensor, embeds: torch.Tensor
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The image rows' mask and each deepstack layer's rows in position order, as ``Qwen3VLModel.forward``
        hands them to its language model."""
        mask = torch.zeros_like(input_ids, dtype=torch.bool)
        mask[rows] = True
        width = embeds.shape[-1]
        layers = features[torch.argsort(rows), width:].to(embeds.dtype)
        deepstack = list(torch.split(layers, width, dim=-1))
        return None, {"visual_pos_masks": mask.unsqueeze(0), "deepstack_visual_embeds": deepstack}


class Mistral3(Family):
    """Mistral 3 (Pixtral's tower): each picture at its own size (``image_sizes``), a run of placeholders per row
    of patches; a batch of pictures padded to the largest, which the tower crops back by their sizes."""

    name = "Mistral 3"

    def counts(self, out: Mapping[str, Any], num_images: int, positions: np.ndarray, processor: Any) -> list[int]:
        patch = processor.patch_size * processor.spatial_merge_size
        return [(h // patch) * (w // patch) for h, w in out["image_sizes"].tolist()]

    def split(self, out: Mapping[str, Any], counts: list[int], processor: Any) -> list[dict[str, Any]]:
        return [
            {"pixel_values": out["pixel_values"][i : i + 1, :, :h, :w], "image_sizes": out["image_sizes"][i : i + 1]}
            for i, (h, w) in enumerate(out["image_sizes"].tolist())
        ]

    @torch.no_grad()
    def encode(self, model: Any, images: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        height = max(image["pixel_values"].shape[2] for image in images)
        width = max(image["pixel_values"].shape[3] for image in images)
        pixels = torch.cat([
            torch.nn.functional.pad(image["pixel_values"], (0, width - image["pixel_values"].shape[3],
                                                            0, height - image["pixel_values"].shape[2]))
            for image in images
        ]).to(model.device, model.dtype)  # fmt: skip
        sizes = torch.cat([image["image_sizes"] for image in images]).to(model.device)
        return list(model.model.get_image_features(pixel_values=pixels, image_sizes=sizes).pooler_output)


class Gemma3(Family):
    """Gemma 3: LLaVA's shape (a fixed number of pooled tokens an image), its image tokens attending both ways."""

    name = "Gemma 3"
    bidirectional = True


class Gemma4(Family):
    """Gemma 4: each picture at its aspect ratio (its patches padded to the processor's budget at ``(-1, -1)``, its
    pooled tokens as many as its real patches give), per-layer inputs from the token ids (an image's positions
    read as padding), image tokens attending both ways on sliding layers where the config says ``vision``."""

    name = "Gemma 4"
    split_problem = (
        "transformers' Gemma 4 forward mixes a split model's distributed tensors with plain ones (its per-layer "
        "inputs' padding row: aten.where)"
    )

    def counts(self, out: Mapping[str, Any], num_images: int, positions: np.ndarray, processor: Any) -> list[int]:
        return [len(run) for run in runs(positions)]  # each image between boi and eoi

    def split(self, out: Mapping[str, Any], counts: list[int], processor: Any) -> list[dict[str, Any]]:
        return [
            {"pixel_values": out["pixel_values"][i : i + 1], "image_position_ids": out["image_position_ids"][i : i + 1]}
            for i in range(len(counts))
        ]

    @torch.no_grad()
    def encode(self, model: Any, images: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        pixels = torch.cat([image["pixel_values"] for image in images]).to(model.device, model.dtype)
        where = torch.cat([image["image_position_ids"] for image in images]).to(model.device)
        return list(model.model.get_image_features(pixels, where).pooler_output)

    def forward_kwargs(
        self, model: Any, input_ids: torch.Tensor, rows: torch.Tensor, features: torch.Tensor, embeds: torch.Tensor
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The per-layer inputs ``Gemma4Model.forward`` makes from the token ids, an image's read as padding."""
        ids = input_ids.clone()
        ids[rows] = model.config.get_text_config().pad_token_id
        language = model.model.language_model
        ids = ids.unsqueeze(0)
        return {"per_layer_inputs": language.get_per_layer_inputs(ids)}, None


FAMILIES: dict[str, type[Family]] = {
    "gemma3": Gemma3, "gemma4": Gemma4, "idefics3": Idefics3, "kimi_k25": KimiK25, "llava": Family,
    "llava_next": LlavaNext, "llava_onevision": LlavaOnevision, "mistral3": Mistral3,
    "qwen2_5_vl": Qwen2_5VL, "qwen3_5": Qwen2_5VL, "qwen3_vl": Qwen3VL, "smolvlm": Idefics3,
}  # fmt: skip
"""The families the engine drives exactly (tests/engine/test_vision_language.py checks each against ``generate``)."""


def runs(positions: np.ndarray) -> list[np.ndarray]:
    """The runs of consecutive positions (image placeholders next to each other: one run)."""
    return np.split(positions, np.flatnonzero(np.diff(positions) != 1) + 1)


def family_of(config: Any) -> Family | None:
    """The family of a vision-language model's config (``None``: not one the engine drives)."""
    cls = FAMILIES.get(config.model_type)
    if cls is None:
        return None
    family = cls()
    vision: Any = config.vision_config
    if isinstance(family, KimiK25):
        family._merged = int(np.prod(vision.merge_kernel_size))
    elif isinstance(family, Qwen2_5VL):
        family._merged = vision.spatial_merge_size**2
    if isinstance(family, Gemma4):  # both ways only where the config asks for it, and only on sliding layers
        family.bidirectional = family.sliding_only = config.get_text_config().use_bidirectional_attention == "vision"
    return family


def check_driven(config: EngineConfig) -> None:
    """A vision-language model whose family the engine does not drive is refused in one line, before its weights
    load."""
    model_config = AutoConfig.from_pretrained(
        resolve_model_path(config.model), revision=config.revision, trust_remote_code=config.trust_remote_code
    )
    if not is_vision_language(model_config):
        return
    family = driven_family(model_config, model_config.model_type)
    if config.world_size > 1 and family.split_problem:
        architecture = next(iter(model_config.architectures or []), model_config.model_type)
        raise ModelNotSupported(architecture, f"{family.split_problem}; serve it on one device")


def driven_family(config: PretrainedConfig, architecture: str) -> Family:
    """The family of a vision-language model the engine drives exactly; ``ModelNotSupported`` (one line) for
    another."""
    family = family_of(config)
    if family is None:
        raise ModelNotSupported(
            architecture,
            f"the engine does not drive {config.model_type!r} vision-language models exactly yet (it drives "
            f"{', '.join(sorted(FAMILIES))})",
        )
    return family
