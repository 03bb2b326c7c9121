"""Model objects (``/v1/models``)."""

from __future__ import annotations

from typing import Literal

from ._base import Wire


class ModelObject(Wire, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "batchgen"
    max_context_length: int


class ModelList(Wire, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelObject]
