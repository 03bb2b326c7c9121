"""vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: LoRA adapters served from now on, or no more.
Refused unless the server runs with ``--enable-lora`` and ``--allow-runtime-lora-updating`` (or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) and, on a server with API keys, the caller holds ``--admin-api-key``. An
adapter loaded is checked at once (its config and weights' header: what the engine cannot apply exactly is refused,
naming it); the engine reads its weights on first use."""

from __future__ import annotations

import asyncio

import msgspec
from litestar import Controller, MediaType, post
from litestar.openapi import ResponseSpec

from batchgen.schemas import ErrorResponse

from ..engine.features.adapters import AdapterRefused, Adapters, name_problem
from ..security.auth import tenant_id
from .deps import ServerContext
from .errors import ERROR_RESPONSES, APIError, invalid, not_found


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):  # other fields ignored, as vLLM does
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str | None = None


def _adapters(context: ServerContext, owner: str) -> Adapters:
    """The adapters served, when ``owner`` may change them: runtime updating is on and, on a server with API keys
    (tenants), the caller holds the operator's key: an adapter is served to every tenant, so no tenant may swap or
    drop another's."""
    settings = context.settings
    adapters = context.serving.adapters
    if adapters is None or not settings.engine.runtime_lora_updating:
        raise APIError(
            403,
            "Loading and unloading LoRA adapters at run time is off: start the server with --enable-lora and "
            "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).",
            code="runtime_lora_updating_disabled",
        )
    if settings.accepted_keys and (settings.admin_api_key is None or owner != tenant_id(settings.admin_api_key)):
        raise APIError(
            403,
            "Only the operator's key (--admin-api-key) may load or unload LoRA adapters on a server with API keys.",
            code="admin_key_required",
        )
    return adapters


RESPONSES = {
    **ERROR_RESPONSES,
    403: ResponseSpec(
        ErrorResponse,
        description="Run-time LoRA updating is off, or the caller is not the operator",
        generate_examples=False,
    ),
}


class LoRAController(Controller):
    tags = ("models",)

    @post("/v1/load_lora_adapter", status_code=200, media_type=MediaType.TEXT, responses=RESPONSES)
    async def load(self, context: ServerContext, owner: str, data: LoadLoRAAdapterRequest) -> str:
        """Serve the PEFT LoRA adapter in ``lora_path`` as the model ``lora_name`` (the operator's key only, on a
        server with API keys)."""
        adapters = _adapters(context, owner)
        if (problem := name_problem(data.lora_name)) is not None:
            raise invalid(problem, param="lora_name")
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
    async def unload(self, context: ServerContext, owner: str, data: UnloadLoRAAdapterRequest) -> str:
        """Serve the adapter ``lora_name`` no more (requests already running with it finish; the operator's key
        only, on a server with API keys)."""
        if not _adapters(context, owner).remove(data.lora_name):
            raise not_found("model", data.lora_name, param="lora_name")
        return f"Success: LoRA adapter '{data.lora_name}' removed successfully."
