"""``create_app(settings)``: the Litestar application, whose lifespan owns the store, the engine and the runner."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar, Router
from litestar.openapi import OpenAPIConfig

from batchgen.schemas import ModelObject

from .api.batches import BatchesController
from .api.deps import DEPENDENCIES, ServerContext, require_api_key
from .api.errors import EXCEPTION_HANDLERS, add_request_id
from .api.files import FilesController
from .api.health import HealthController, PoolController
from .api.legacy import legacy_inference
from .api.models import ModelsController
from .batches.runner import BatchRunner
from .engine import EngineWorker, LLMEngine
from .serving import OpenAIServing
from .settings import MIB, Settings
from .storage.blobs import BlobStore
from .storage.database import Database

ENGINE_STOP_TIMEOUT_S = 30.0


def create_app(settings: Settings) -> Litestar:
    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        settings.storage_dir.mkdir(parents=True, exist_ok=True)
        db = Database(settings.database_path)
        blobs = BlobStore(settings.blobs_dir)
        engine = await asyncio.to_thread(LLMEngine.from_config, settings.engine)
        worker = EngineWorker(engine)
        worker.start()
        serving = OpenAIServing(engine.tokenizer, engine.model_name, engine.max_context_length, engine.tasks)
        runner = BatchRunner(settings=settings, db=db, blobs=blobs, serving=serving, engine=worker)
        model = ModelObject(
            id=engine.model_name, created=int(time.time()), max_context_length=engine.max_context_length
        )
        app.state.context = ServerContext(settings, db, blobs, model, worker, runner)
        await runner.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop, ENGINE_STOP_TIMEOUT_S)
            await runner.stop()
            db.close()

    api = Router(
        path="/",
        route_handlers=[ModelsController, FilesController, BatchesController, PoolController, legacy_inference],
        guards=[require_api_key],
    )
    return Litestar(
        route_handlers=[api, HealthController],
        dependencies=DEPENDENCIES,
        exception_handlers=EXCEPTION_HANDLERS,
        before_send=[add_request_id],
        lifespan=[lifespan],
        # Multipart overhead on top of the largest file; the file part itself is limited exactly while it streams.
        request_max_body_size=settings.max_upload_bytes + MIB,
        openapi_config=OpenAPIConfig(
            title="batchgen",
            version="0.1.0",
            description="OpenAI-compatible batch inference: Files and Batches API over batchgen's own engine.",
        ),
    )
