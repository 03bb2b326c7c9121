"""``/v1/models``: the one model this server runs."""

from __future__ import annotations

from litestar import Controller, get

from batchgen.schemas import ModelList, ModelObject

from .deps import ServerContext
from .errors import ERROR_RESPONSES, not_found


class ModelsController(Controller):
    path = "/v1/models"
    tags = ("models",)

    @get(summary="List the loaded model", responses=ERROR_RESPONSES)
    async def list_models(self, context: ServerContext) -> ModelList:
        return ModelList(data=[context.model])

    @get("/{model_id:path}", summary="Retrieve the loaded model (404 for any other id)", responses=ERROR_RESPONSES)
    async def retrieve(self, context: ServerContext, model_id: str) -> ModelObject:
        model_id = model_id.lstrip("/")
        if model_id != context.model.id:
            raise not_found("model", model_id, param="model")
        return context.model
