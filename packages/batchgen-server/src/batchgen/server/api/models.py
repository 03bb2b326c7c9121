"""``/v1/models``: the one model this server runs, under each of its names (``--served-model-name``), and the LoRA
adapters served beside it, each with the model as its ``parent``."""

from __future__ import annotations

from litestar import Controller, get

from batchgen.schemas import ModelList, ModelObject

from .deps import ServerContext
from .errors import ERROR_RESPONSES, not_found


def served_models(context: ServerContext) -> list[ModelObject]:
    """The model under each name, then each adapter served now (they come and go at run time)."""
    adapters = context.serving.adapters
    base = context.model
    return [
        *context.models,
        *(
            ModelObject(
                id=lora.name,
                created=base.created,
                max_context_length=base.max_context_length,
                parent=base.id,
                root=lora.path,
            )
            for lora in (adapters.served() if adapters is not None else ())
        ),
    ]


class ModelsController(Controller):
    path = "/v1/models"
    tags = ("models",)

    @get(
        summary="List the loaded model, under each name it is served by, and its LoRA adapters",
        responses=ERROR_RESPONSES,
    )
    async def list_models(self, context: ServerContext) -> ModelList:
        return ModelList(data=served_models(context))

    @get(
        "/{model_id:path}",
        summary="Retrieve the loaded model or an adapter (404 for any other name)",
        responses=ERROR_RESPONSES,
    )
    async def retrieve(self, context: ServerContext, model_id: str) -> ModelObject:
        model_id = model_id.lstrip("/")
        for model in served_models(context):
            if model.id == model_id:
                return model
        raise not_found("model", model_id, param="model")
