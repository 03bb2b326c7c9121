"""``create_app(settings)``: the Litestar application, whose lifespan owns the store, the engine, the batch loop,
the completion callbacks and the expired-file sweep."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from litestar import Litestar, Router
from litestar.datastructures import State

from batchgen.schemas import BatchObject, ModelObject

from . import startup_heap
from .api.batches import BatchesController
from .api.deps import DEPENDENCIES, ServerContext, admit_while_running
from .api.engine_calls import OnlineRequests
from .api.errors import EXCEPTION_HANDLERS, add_request_id
from .api.files import FilesController
from .api.health import HealthController, PoolController
from .api.legacy import legacy_inference
from .api.lora import LoRAController
from .api.models import ModelsController
from .api.online import OnlineController
from .api.openapi import BEARER_AUTH, openapi_config
from .api.options import allow_route_methods
from .api.pooling import PoolingController
from .api.preparations import Preparations
from .api.responses import ResponsesController
from .batches.crashes import CrashJournal
from .batches.loop import BatchLoop
from .batches.stores import DatabaseStore
from .callbacks import CallbackNotifier
from .console import console_assets, console_page
from .engines import load_engine, replica_states, window_for
from .media.files import UploadedImages
from .observability.logs import log_activity
from .observability.metrics import Metrics, ServerState
from .security.auth import ApiKeyAuthMiddleware
from .serving import OpenAIServing
from .serving.structured import stop_grammar_probes
from .settings import MIB, Settings
from .storage.blobs import BlobStore
from .storage.database import Database
from .storage.expiry import sweep_forever

if TYPE_CHECKING:
    from .engine import EngineClient

log = logging.getLogger("batchgen.server")


def create_app(settings: Settings, engine: EngineClient | None = None) -> Litestar:
    """The app; it loads ``settings.engine``'s model at start-up (on ``settings.cluster``'s replicas, if any) unless
    given the ``engine`` (``serve`` loads it first, so that a model that cannot be loaded is one line and an exit
    status, not a failed start-up)."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        # What starts is stopped in reverse, also when a later part fails to start (nothing leaks from a failed start).
        async with contextlib.AsyncExitStack() as started:
            settings.storage_dir.mkdir(parents=True, exist_ok=True)
            db = Database(settings.database_path)
            started.callback(db.close)
            blobs = BlobStore(settings.blobs_dir)
            sweeper = asyncio.create_task(sweep_forever(db, blobs, settings.file_sweep_interval_s))
            started.push_async_callback(_cancel, sweeper)
            notifier = CallbackNotifier(settings.callbacks)
            await notifier.start()
            started.push_async_callback(notifier.stop)
            nonlocal engine
            if engine is None:
                engine = await asyncio.to_thread(load_engine, settings.engine, settings.cluster)
            serving = await asyncio.to_thread(
                OpenAIServing.for_engine, engine, settings.engine, settings.serving, settings.max_line_sequences
            )
            sources = serving.preparer.images.sources
            sources.files = UploadedImages(db, blobs)  # images named by file id
            started.callback(sources.fetcher.close)
            started.callback(stop_grammar_probes)
            if not settings.serving.serve_local_media and sources.local_root is not None:
                log.warning("--allowed-local-media-path is run-batch's: serve reads it only with --serve-local-media")
                sources.local_root = None  # every caller of the server could read the operator's folder
            metrics: Metrics | None = None

            def on_finished(batch: BatchObject) -> None:
                notifier.notify(batch)
                if metrics is not None:
                    metrics.observe_batch(batch)

            loop = BatchLoop(
                DatabaseStore(db, blobs, on_finished=on_finished),
                serving,
                engine,
                capacity=settings.max_queued_requests,
                window=settings.engine_window or window_for(engine),
                flush_interval_s=settings.flush_interval_s,
                limits=settings.validation_limits,
                journal=CrashJournal(settings.storage_dir / "inflight.journal"),
            )
            created = int(time.time())
            models = [
                ModelObject(id=name, created=created, max_context_length=engine.max_context_length)
                for name in serving.model_names
            ]
            capacity = settings.max_online_sequences or 2 * settings.engine.max_num_seqs
            online = OnlineRequests(engine, capacity, settings.max_stream_backlog_tokens)
            metrics = Metrics(
                engine.model_name,
                ServerState(
                    engine=engine.stats,
                    engine_state=lambda: engine.state,
                    engine_restarts=lambda: engine.restarts,
                    queued_sequences=lambda: loop.status.queued_sequences,
                    storage_fault=lambda: loop.status.storage_fault,
                    batch_counts=db.batch_status_counts,
                    line_counts=db.request_totals,
                    replicas=lambda: replica_states(engine),
                ),
            )
            engine.observer = metrics.observe_request
            preparations = Preparations(tenants=len(settings.accepted_keys) > 1)
            started.callback(preparations.close)
            app.state.context = ServerContext(
                settings, db, blobs, models, engine, loop, metrics, serving, online, preparations
            )
            # In-flight requests are done when these stop (uvicorn drained them); the rest of the shutdown deadline is
            # theirs: the engine first (no result reaches a stopped loop), then the loop.
            deadline_s = settings.shutdown_timeout_s / 4
            engine.start()
            try:
                loop.start()
            except BaseException:
                await asyncio.to_thread(engine.stop, deadline_s)
                raise
            started.push_async_callback(asyncio.to_thread, _stop, engine, loop, deadline_s)
            if settings.log_interval_s > 0:
                activity = log_activity(engine.stats, lambda: loop.status.active_batches, settings.log_interval_s)
                started.push_async_callback(_cancel, asyncio.create_task(activity))
            startup_heap.freeze()  # everything long-lived exists now
            started.callback(gc.unfreeze)
            yield

    # Online bodies are read whole before they are decoded: their own, smaller limit (uploads stream to disk).
    online = Router(
        path="/",
        route_handlers=[OnlineController, PoolingController, ResponsesController],
        request_max_body_size=settings.max_online_body_bytes,
    )
    api = Router(
        path="/",
        route_handlers=[
            ModelsController,
            LoRAController,
            FilesController,
            BatchesController,
            online,
            PoolController,
            legacy_inference,
        ],
        guards=[admit_while_running],
        security=BEARER_AUTH,
    )
    auth = ApiKeyAuthMiddleware(settings.accepted_keys)
    return Litestar(
        route_handlers=[api, HealthController, console_page, console_assets],
        middleware=[auth],
        dependencies=DEPENDENCIES,
        exception_handlers=EXCEPTION_HANDLERS,
        before_send=[add_request_id, allow_route_methods],
        lifespan=[lifespan],
        # ``auth`` also answers unrouted requests (errors.py); ``draining`` is set by the SIGTERM handler (serve.py).
        state=State({"auth": auth, "draining": threading.Event()}),
        # Multipart overhead on top of the largest file; the file part itself is limited exactly while it streams.
        request_max_body_size=settings.max_upload_bytes + MIB,
        openapi_config=openapi_config(),
        logging_config=None,  # serve configures logging (text or JSON); Litestar's own config would replace it
    )


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _stop(engine: EngineClient, loop: BatchLoop, timeout_s: float) -> None:
    engine.stop(timeout_s)
    loop.stop(timeout_s)
