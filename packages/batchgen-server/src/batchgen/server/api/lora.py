"""vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: LoRA adapters served from now on, or no more.
Refused unless the server runs with ``--enable-lora`` and ``--allow-runtime-lora-updating`` (or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``). An adapter loaded is checked at once (its config and weights' names: what
the engine cannot apply exactly is refused, naming it); the engine reads its weights on first use."""

from __future__ import annotations

import asyncio

import msgspec
from litestar import Controller, MediaType, post
from litestar.openapi import ResponseSpec

from batchgen.schemas import ErrorResponse

from ..engine.adapters import AdapterRefused, Adapters
from .deps import ServerContext
from .errors import ERROR_RESPONSES, APIError, invalid, not_found


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):  # other fields ignored, as vLLM does
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str | None = None


def _adapters(context: ServerContext) -> Adapters:
    adapters = context.serving.adapters
    if adapters is None or not context.settings.engine.runtime_lora_updating:
        raise APIError(
            403,
            "Loading and unloading LoRA adapters at run time is off: start the server with --enable-lora and "
            "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).",
            code="runtime_lora_updating_disabled",
        )
    return adapters


RESPONSES = {
    **ERROR_RESPONSES,
    403: ResponseSpec(ErrorResponse, description="Run-time LoRA updating is off", generate_examples=False),
}


class LoRAController(Controller):
    tags = ("models",)

    @post("/v1/load_lora_adapter", status_code=200, media_type=MediaType.TEXT, responses=RESPONSES)
    async def load(self, context: ServerContext, data: LoadLoRAAdapterRequest) -> str:
        """Serve the PEFT LoRA adapter in ``lora_path`` as the model ``lora_name``."""
        adapters = _adapters(context)
        if data.lora_name in context.serving.model_names:
            raise invalid(f"{data.lora_name!r} is the base model's name", param="lora_name")
        try:
            await asyncio.to_thread(adapters.add, data.lora_name, data.lora_path)
        except AdapterRefused as exc:
            raise invalid(str(exc), param="lora_path", code="invalid_adapter") from None
        except ValueError as exc:
            raise invalid(str(exc), param="lora_name", code="adapter_exists") from None
        return f"Success: LoRA adapter '{data.lora_name}' added successfully."

    @post("/v1/unload_lora_adapter", status_code=200, media_type=MediaType.TEXT, responses=RESPONSES)
    async def unload(self, context: ServerContext, data: UnloadLoRAAdapterRequest) -> str:
        """Serve the adapter ``lora_name`` no more (requests already running with it finish)."""
        if not _adapters(context).remove(data.lora_name):
            raise not_found("model", data.lora_name, param="lora_name")
        return f"Success: LoRA adapter '{data.lora_name}' removed successfully."
