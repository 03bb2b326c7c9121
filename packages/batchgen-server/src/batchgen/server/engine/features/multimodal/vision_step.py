"""The vision step of an engine step: the images whose placeholders the step's prefill chunks reach are encoded
first, in one batch through the vision tower (those not in the encoder cache), and their rows put in place of the
placeholder tokens' embeddings; the language model then runs on those embeddings (``inputs_embeds``), with M-RoPE
models' 3-D positions. A chunk may start or end inside an image's placeholders: it takes just those rows.

Two halves, so that a split model's ranks run the second together: ``gather`` (the driver alone: the encoder rows
and the positions, ``StepImages``, which a group's channel sends on) and ``assemble`` (every rank: the embeddings,
looked up together where the vocabulary is split, with the rows in place)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import ModelNotSupported
from ...loading.loader import is_vision_language
from .encoder_cache import EncoderCache
from .families import Family, driven_family
from .prompt import ImageInput, MultimodalPrompt


def attention_for(model: Any, name: str) -> str | dict[str, Any]:
    """``name`` for the language model's attention only: a vision tower keeps its own (it attends over an image's
    patches, never the paged cache)."""
    config = model.config
    sub = [key for key in getattr(config, "sub_configs", {}) if key != "text_config" and getattr(config, key, None)]
    if not sub:
        return name
    return {"": name, "text_config": name, **{key: getattr(config, key)._attn_implementation for key in sub}}


@dataclass(frozen=True, slots=True)
class StepInputs:
    embeds: torch.Tensor | None
    """``[1, tokens, hidden]``: the packed row's embeddings, image rows in place; ``None``: the step has none."""
    positions: torch.Tensor | None
    """``[3, 1, tokens]`` M-RoPE positions; ``None``: the packed row's own."""
    base: dict[str, Any] | None = None
    """What the model's own ``forward`` would hand its base model besides embeddings (Gemma 4's per-layer
    inputs), by family (``Family.forward_kwargs``)."""
    language: dict[str, Any] | None = None
    """What it would hand its language model (Qwen3-VL's deepstack rows and their mask)."""

    @contextmanager
    def around(self, model: Any) -> Iterator[None]:
        """The model's forward with ``base`` and ``language`` handed on, for this forward only."""
        handles = []
        if self.base:
            handles.append(model.model.register_forward_pre_hook(_adding(self.base), with_kwargs=True))
        if self.language:
            language = model.model.language_model
            handles.append(language.register_forward_pre_hook(_adding(self.language), with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _adding(extra: dict[str, Any]) -> Any:
    def hand(module: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return args, {**kwargs, **extra}

    return hand


NO_EXTRA = StepInputs(None, None)
"""A step of a text model, or of a vision-language model with no image in it."""


@dataclass(frozen=True, slots=True)
class StepImages:
    """What a step's images give its forward, on every rank alike."""

    rows: torch.Tensor | None
    """The packed rows of the step's image placeholders (int64, on the host); ``None``: the step reaches none."""
    features: torch.Tensor | None
    """``[rows, width]``: their encoder rows (a family's may be wider than the embeddings: deepstack)."""
    positions: np.ndarray | None
    """``[3, tokens]`` M-RoPE positions of the packed row; ``None``: its own."""


class VisionStep:
    def __init__(self, model: Any, family: Family, cache_bytes: int) -> None:
        self.model = model
        self.family = family
        self.cache = EncoderCache(cache_bytes)
        self.encoded_images = 0
        """Images run through the vision tower so far (the encoder cache's misses that were encoded)."""

    def gather(self, scheduled: Sequence[Any]) -> StepImages | None:
        """The step's image rows, encoded, and its positions (``scheduled``: the ``ScheduledSeq``s, in the packed
        row's order); ``None``: the step needs neither (no sequence of it has images, or it reaches none of them and
        the family's positions are plain)."""
        wanted: list[tuple[int, int, int, ImageInput]] = []  # (packed row of the chunk, its start, tokens, image)
        positions: list[np.ndarray] | None = [] if self.family.mrope else None
        any_mm = False
        row = 0
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            mm: MultimodalPrompt | None = seq.state.request.multimodal
            if mm is not None:
                any_mm = True
                for image in mm.images:
                    if image.first < start + n and image.last >= start:
                        wanted.append((row, start, n, image))
            if positions is not None:
                positions.append(self._positions(seq, mm, start, n))
            row += n
        if not any_mm or (not wanted and positions is None):
            return None
        rows, features = self._rows(wanted) if wanted else (None, None)
        return StepImages(rows, features, None if positions is None else np.concatenate(positions, axis=1))

    def assemble(self, images: StepImages, input_ids: torch.Tensor) -> StepInputs:
        """What the step's forward takes besides its token ids: its embeddings with the image rows in place, and
        the positions (every rank of a split model runs it, the embedding lookups being collective)."""
        embeds = base = language = None
        if images.rows is not None and images.features is not None:
            embeds = self.model.get_input_embeddings()(input_ids.unsqueeze(0))
            rows, features = images.rows.to(input_ids.device), images.features.to(input_ids.device)
            width = embeds.shape[-1]  # a family's rows may carry more columns than the embeddings (deepstack)
            embeds[0].index_copy_(0, rows, features[:, :width].to(embeds.dtype))
            base, language = self.family.forward_kwargs(self.model, input_ids, rows, features, embeds)
        mrope = None
        if images.positions is not None:
            mrope = torch.from_numpy(np.ascontiguousarray(images.positions)).unsqueeze(1).to(input_ids.device)
        return StepInputs(embeds, mrope, base, language)

    def _rows(self, wanted: list[tuple[int, int, int, ImageInput]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed rows of the step's image placeholders, and their encoder rows."""
        features = self._encode([image for *_, image in wanted])
        rows: list[np.ndarray] = []
        chosen: list[torch.Tensor] = []
        for row, start, n, image in wanted:
            where = image.placeholders
            inside = np.flatnonzero((where >= start) & (where < start + n))  # this chunk's placeholders only
            rows.append(where[inside] - start + row)
            chosen.append(features[image.key][torch.from_numpy(inside)])
        return torch.from_numpy(np.concatenate(rows)), torch.cat(chosen)

    def _encode(self, images: list[ImageInput]) -> dict[bytes, torch.Tensor]:
        """Every image's encoder output: from the cache, or the missing ones in one batch through the tower."""
        found: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, ImageInput] = {}
        for image in images:
            if image.key in found or image.key in missing:
                continue
            cached = self.cache.get(image.key)
            if cached is None:
                missing[image.key] = image
            else:
                found[image.key] = cached
        if missing:
            outputs = self.family.encode(self.model, [image.pixels for image in missing.values()])
            self.encoded_images += len(missing)
            for key, output in zip(missing, outputs, strict=True):
                found[key] = output
                self.cache.put(key, output)
        return found

    def _positions(self, seq: Any, mm: MultimodalPrompt | None, start: int, n: int) -> np.ndarray:
        """``[3, n]`` M-RoPE positions of the sequence's tokens ``start`` to ``start + n``."""
        span = np.arange(start, start + n)
        if mm is None:
            return np.broadcast_to(span, (3, n))
        if mm.mrope is None:
            mm.mrope, mm.mrope_delta = self.family.rope(self.model, seq.state.request.prompt_token_ids, mm)
        prompt = mm.mrope.shape[1]
        if start + n <= prompt:
            return mm.mrope[:, start : start + n]
        out = np.broadcast_to(span + mm.mrope_delta, (3, n)).copy()
        if start < prompt:
            out[:, : prompt - start] = mm.mrope[:, start:]
        return out


def both_ways_refused(architecture: str, config: Any) -> None:
    """Image tokens attending both ways (``MultimodalPrompt.spans``) are masked by the gather backend (on every rank
    of a group: the step carries each sequence's spans); ``ModelNotSupported`` where the engine would run flex."""
    if config.attention_backend == "flex":
        raise ModelNotSupported(
            architecture,
            "its image tokens attend to each other both ways, which only --attention-backend gather masks",
        )


def vision_step_for(model: Any, cache_bytes: int) -> VisionStep | None:
    """The vision step of a vision-language model (``None`` for a text model)."""
    if not is_vision_language(model.config):
        return None
    return VisionStep(model, driven_family(model.config, type(model).__name__), cache_bytes)
