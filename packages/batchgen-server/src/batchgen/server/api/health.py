"""Operations: ``/health``, ``/v1/pool/status`` and Prometheus ``/metrics``."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from litestar import Controller, Response, get
from litestar.openapi import ResponseSpec
from litestar.status_codes import HTTP_200_OK, HTTP_503_SERVICE_UNAVAILABLE

from batchgen.schemas import HealthStatus, PoolStatus, ReplicaStatus

from ..batches.lifecycle import STATUSES
from ..replicas.pool import ReplicaPool
from .deps import ServerContext
from .errors import ERROR_RESPONSES

THROUGHPUT_WINDOW_S = 60.0


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
        worker, fault, replicas = context.worker, context.loop.status.storage_fault, _replicas(context)
        if worker.healthy and fault is None:
            body = HealthStatus(status="healthy", model=context.model.id, replicas=replicas)
            return Response(body, status_code=HTTP_200_OK)
        if not worker.healthy:
            state = "restarting after a failure" if worker.state == "restarting" else "stopped"
            reason = f"engine {state}: {worker.error!r}" if worker.error else "engine not running"
        else:
            reason = f"storage fault: {fault}; batches are paused until results can be written again"
        body = HealthStatus(status="unhealthy", reason=reason, model=context.model.id, replicas=replicas)
        return Response(body, status_code=HTTP_503_SERVICE_UNAVAILABLE)

    @get("/metrics", media_type="text/plain; version=0.0.4", summary="Prometheus metrics")
    async def metrics(self, context: ServerContext) -> str:
        return await asyncio.to_thread(render_metrics, context)


class PoolController(Controller):
    path = "/v1/pool"
    tags = ("operations",)

    @get("/status", summary="Queued and running requests, capacity and active batches", responses=ERROR_RESPONSES)
    async def status(self, context: ServerContext) -> PoolStatus:
        stats, loop = context.worker.stats(), context.loop.status
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
            replicas=_replicas(context),
        )


class _Throughput:
    """Generated tokens per second over the last minute, from the engine's running total sampled at each scrape."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()

    def rate(self, generated_total: int) -> float:
        now = time.monotonic()
        self._samples.append((now, generated_total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= THROUGHPUT_WINDOW_S:
            self._samples.popleft()
        t0, g0 = self._samples[0]
        return (generated_total - g0) / (now - t0) if now > t0 else 0.0


_throughput = _Throughput()


def render_metrics(context: ServerContext) -> str:
    stats = context.worker.stats()
    totals = context.db.request_totals()
    batches = context.db.batch_status_counts()
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"))
        lines.extend(f"{name}{labels} {value:g}" for labels, value in samples)

    metric(
        "batchgen_requests_total",
        "counter",
        "Batch requests finished, by outcome.",
        [('{outcome="completed"}', totals["completed"]), ('{outcome="failed"}', totals["failed"])],
    )
    metric(
        "batchgen_tokens_total",
        "counter",
        "Tokens processed by the engine since start, by kind.",
        [
            ('{kind="prompt"}', stats.prompt_tokens),
            ('{kind="cached"}', stats.cached_tokens),
            ('{kind="generated"}', stats.generated_tokens),
        ],
    )
    metric(
        "batchgen_generation_throughput_tokens_per_second",
        "gauge",
        f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:g} s.",
        [("", _throughput.rate(stats.generated_tokens))],
    )
    metric(
        "batchgen_queued_requests",
        "gauge",
        "Requests accepted and not yet running.",
        [("", _queued(context, stats.running))],
    )
    metric("batchgen_running_requests", "gauge", "Sequences running in the engine.", [("", stats.running)])
    metric(
        "batchgen_capacity_requests",
        "gauge",
        "Queue capacity before 429.",
        [("", context.settings.max_queued_requests)],
    )
    metric(
        "batchgen_kv_blocks",
        "gauge",
        "KV-cache blocks, by state.",
        [('{state="free"}', stats.kv_blocks_free), ('{state="total"}', stats.kv_blocks_total)],
    )
    metric("batchgen_preemptions_total", "counter", "Sequences preempted for KV space.", [("", stats.preemptions)])
    metric(
        "batchgen_batches",
        "gauge",
        "Batches, by status.",
        [(f'{{status="{status}"}}', batches.get(status, 0)) for status in STATUSES],
    )
    metric("batchgen_engine_healthy", "gauge", "1 while the engine runs.", [("", 1 if context.worker.healthy else 0)])
    return "\n".join(lines) + "\n"


def _replicas(context: ServerContext) -> list[ReplicaStatus] | None:
    """Each replica's state with ``--replicas``; ``None`` with the single in-process engine."""
    worker = context.worker
    return worker.replicas() if isinstance(worker, ReplicaPool) else None


def _queued(context: ServerContext, running: int) -> int:
    """Accepted sequences not finished, less those the engine is running."""
    return max(0, context.loop.status.queued_sequences - running)
