"""``/v1/models``: the one model this server runs, under each of its names (``--served-model-name``)."""

from __future__ import annotations

from litestar import Controller, get

from batchgen.schemas import ModelList, ModelObject

from .deps import ServerContext
from .errors import ERROR_RESPONSES, not_found


class ModelsController(Controller):
    path = "/v1/models"
    tags = ("models",)

    @get(summary="List the loaded model, under each name it is served by", responses=ERROR_RESPONSES)
    async def list_models(self, context: ServerContext) -> ModelList:
        return ModelList(data=context.models)

    @get("/{model_id:path}", summary="Retrieve the loaded model (404 for any other name)", responses=ERROR_RESPONSES)
    async def retrieve(self, context: ServerContext, model_id: str) -> ModelObject:
        model_id = model_id.lstrip("/")
        for model in context.models:
            if model.id == model_id:
                return model
        raise not_found("model", model_id, param="model")
