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
    parent: str | None = None
    """A LoRA adapter's base model (``None`` for the base itself)."""
    root: str | None = None
    """Where the model was loaded from: a LoRA adapter's directory."""


class ModelList(Wire, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelObject]
