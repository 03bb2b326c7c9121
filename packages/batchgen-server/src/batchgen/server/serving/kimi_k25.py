"""Kimi K2.5's image processor without torchvision: transformers writes ``Kimi_K25ImageProcessor`` for torchvision
alone (its module imports it), though what it does is Pillow's and NumPy's work. This is its ``_preprocess`` as
transformers 5.25 writes it, on transformers' Pillow backend: each picture resized (bicubic) to at most
``max_patches`` patches and ``size`` pixels a side, padded at its bottom and right to a multiple of
``patch_size * merge_size``, rescaled, normalized and cut into ``patch_size`` squares, row by row.

Where torchvision is installed transformers' own serves (``image_processor.py``); Pillow's and torchvision's bicubic
resizes (both antialiased) may differ by a level in a few pixels."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
from transformers import BatchFeature
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict
from transformers.processing_utils import ImagesKwargs


class KimiK25ImagesKwargs(ImagesKwargs, total=False):  # type: ignore[misc, call-arg]  # transformers' TypedDict
    max_patches: int
    patch_size: int
    merge_size: int


def navit_resize(
    height: int, width: int, patch_size: int, merge_size: int, max_patches: int, max_side: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The picture's size after resizing, and after padding: transformers' ``navit_resize`` (its module needs
    torchvision)."""
    patches = max(1.0, height // patch_size) * max(1.0, width // patch_size)
    scale = min(
        1.0, math.sqrt(max_patches / patches), (max_side * patch_size) / height, (max_side * patch_size) / width
    )
    new_height = min(max(1, int(height * scale)), max_side * patch_size)
    new_width = min(max(1, int(width * scale)), max_side * patch_size)
    factor = merge_size * patch_size
    return (new_height, new_width), (-(-new_height // factor) * factor, -(-new_width // factor) * factor)


class KimiK25ImageProcessorPil(PilBackend):  # type: ignore[misc]
    do_resize = True
    resample = PILImageResampling.BICUBIC
    size: ClassVar[dict[str, int]] = {"max_height": 512, "max_width": 512}
    max_patches = 16384
    do_rescale = True
    do_normalize = True
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    do_convert_rgb = True
    patch_size = 14
    merge_size = 2
    valid_kwargs = KimiK25ImagesKwargs
    model_input_names: ClassVar[list[str]] = ["pixel_values", "image_grid_thw"]

    def _preprocess(
        self,
        images: list[np.ndarray],
        do_resize: bool,
        size: SizeDict,
        resample: Any,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: Any,
        image_std: Any,
        patch_size: int,
        merge_size: int,
        max_patches: int,
        return_tensors: Any,
        **kwargs: Any,
    ) -> BatchFeature:
        all_patches, grids = [], []
        for image in images:  # channels first
            if do_resize:
                height, width = image.shape[-2:]
                (height, width), padded = navit_resize(
                    height, width, patch_size, merge_size, max_patches, int(size.max_height)
                )
                image = self.resize(image, SizeDict(height=height, width=width), resample=resample)
                image = self.pad([image], pad_size=SizeDict(height=padded[0], width=padded[1]))[0]
            if do_rescale:
                image = self.rescale(image, rescale_factor)
            if do_normalize:
                image = self.normalize(image, image_mean, image_std)
            channels, rows, columns = image.shape[0], image.shape[1] // patch_size, image.shape[2] // patch_size
            patches = image.reshape(channels, rows, patch_size, columns, patch_size).transpose(1, 3, 0, 2, 4)
            all_patches.append(patches.reshape(rows * columns, channels, patch_size, patch_size))
            grids.append([1, rows, columns])
        return BatchFeature(
            data={"pixel_values": np.concatenate(all_patches), "image_grid_thw": np.array(grids, dtype=np.int64)},
            tensor_type=return_tensors,
        )
