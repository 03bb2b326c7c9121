"""Operations: ``/health``, ``/v1/pool/status`` and Prometheus ``/metrics``."""

from __future__ import annotations

import asyncio

from litestar import Controller, Response, get
from litestar.openapi import ResponseSpec
from litestar.status_codes import HTTP_200_OK, HTTP_503_SERVICE_UNAVAILABLE

from batchgen.schemas import HealthStatus, KVCacheCapacity, PoolStatus

from ..engines import replica_states
from ..observability.metrics import CONTENT_TYPE
from .deps import ServerContext
from .errors import ERROR_RESPONSES


class HealthController(Controller):
    tags = ("operations",)

    @get(
        "/health",
        summary="200 when the engine runs and results can be written, 503 with a reason otherwise",
        responses={
            503: ResponseSpec(
                HealthStatus,
                description="The engine is not running, or results cannot be written",
                generate_examples=False,
            )
        },
    )
    async def health(self, context: ServerContext) -> Response[HealthStatus]:
        engine, fault, replicas = context.engine, context.loop.status.storage_fault, replica_states(context.engine)
        if engine.healthy and fault is None:
            body = HealthStatus(
                status="healthy", model=context.model.id, kv_cache=_kv_cache(context), replicas=replicas
            )
            return Response(body, status_code=HTTP_200_OK)
        if not engine.healthy:
            state = "restarting after a failure" if engine.state == "restarting" else "stopped"
            reason = f"engine {state}: {engine.error!r}" if engine.error else "engine not running"
        else:
            reason = f"storage fault: {fault}; batches are paused until results can be written again"
        body = HealthStatus(status="unhealthy", reason=reason, model=context.model.id, replicas=replicas)
        return Response(body, status_code=HTTP_503_SERVICE_UNAVAILABLE)

    @get("/metrics", media_type=CONTENT_TYPE, summary="Prometheus metrics (docs/server.md lists the families)")
    async def metrics(self, context: ServerContext) -> bytes:
        return await asyncio.to_thread(context.metrics.render)


def _kv_cache(context: ServerContext) -> KVCacheCapacity | None:
    stats = context.engine.stats()
    if not stats.kv_cache_dtype:
        return None
    return KVCacheCapacity(
        dtype=stats.kv_cache_dtype,
        tokens=stats.kv_cache_tokens,
        blocks=stats.kv_blocks_total,
        bytes=stats.kv_cache_bytes,
        state_slots=stats.state_slots,
        state_checkpoints=stats.state_checkpoints,
        state_bytes_per_sequence=stats.state_bytes_per_seq,
        state_bytes=stats.state_cache_bytes,
    )


class PoolController(Controller):
    path = "/v1/pool"
    tags = ("operations",)

    @get("/status", summary="Queued and running requests, capacity and active batches", responses=ERROR_RESPONSES)
    async def status(self, context: ServerContext) -> PoolStatus:
        stats, loop = context.engine.stats(), context.loop.status
        return PoolStatus(
            queued_requests=_queued(context, stats.running),
            running_requests=stats.running,
            capacity=context.settings.max_queued_requests,
            active_batches=loop.active_batches,
            kv_blocks_total=stats.kv_blocks_total,
            kv_blocks_free=stats.kv_blocks_free,
            prompt_tokens=stats.prompt_tokens,
            generated_tokens=stats.generated_tokens,
            storage_fault=loop.storage_fault,
            replicas=replica_states(context.engine),
        )


def _queued(context: ServerContext, running: int) -> int:
    """Accepted sequences not finished, less those the engine is running."""
    return max(0, context.loop.status.queued_sequences - running)
