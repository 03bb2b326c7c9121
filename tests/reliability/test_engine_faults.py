"""No request can stop the engine, over the real API: a line that breaks a step fails alone, with a server_error
line, while the other lines, and another tenant's batch running meanwhile, complete untouched and /health stays 200;
and an engine that dies for good says why on /health, keeps every accepted batch request unanswered for the next
process, answers online calls 503, and still lets a batch be cancelled.

The faults are injected into the in-process server's model (its transformers class) and scheduler: the only fakes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
from litestar.types import ASGIApp
from server_helpers import LiveServer, chat_line
from transformers import LlamaModel

from batchgen.server.app import create_app
from batchgen.server.engine.config import EngineConfig
from batchgen.server.engine.core.scheduler import Scheduler
from batchgen.server.settings import Settings

MARKER = [14, 15, 16]
"""Byte tokens no self-check or chat template produces: a prompt holding them breaks the forward it is in."""
KEYS = ("key-tenant-a", "key-tenant-b")


def _holds_marker(ids: list[int]) -> bool:
    return any(ids[i : i + len(MARKER)] == MARKER for i in range(len(ids) - len(MARKER) + 1))


@pytest.fixture(scope="module")
def broken_forward() -> Iterator[None]:
    forward = LlamaModel.forward

    def faulty(self: LlamaModel, input_ids: Any = None, **kwargs: Any) -> Any:
        if input_ids is not None and _holds_marker(input_ids[0].tolist()):
            raise RuntimeError("injected forward fault")
        return forward(self, input_ids=input_ids, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LlamaModel, "forward", faulty)
        yield


def _server(serve: Callable[[ASGIApp], AbstractContextManager[str]], storage: Any) -> AbstractContextManager[str]:
    settings = Settings(
        storage_dir=storage,
        api_keys=KEYS,
        flush_interval_s=0.05,
        engine=EngineConfig(torch_threads=1, cpu_kv_cache_gib=0.0625),
    )
    return serve(create_app(settings))


def test_a_poisoned_line_fails_alone(
    broken_forward: None,
    serve: Callable[[ASGIApp], AbstractContextManager[str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    storage = tmp_path_factory.mktemp("poison")
    with _server(serve, storage) as base_url:
        tenant_a = LiveServer(base_url=base_url, storage_dir=storage, api_key=KEYS[0])
        tenant_b = LiveServer(base_url=base_url, storage_dir=storage, api_key=KEYS[1])
        good = [chat_line(f"a{i}", content=f"question {i}", max_tokens=6, ignore_eos=True) for i in range(8)]
        poison = [
            chat_line("breaks-the-forward", content="see \x0e\x0f\x10 here", max_tokens=6),
            chat_line("huge-top-k", max_tokens=6, temperature=1.0, top_k=2147483647, seed=1, ignore_eos=True),
        ]
        other = [chat_line(f"b{i}", content=f"other {i}", max_tokens=6, ignore_eos=True) for i in range(10)]
        statuses: list[int] = []
        done = threading.Event()

        def watch_health() -> None:
            while not done.is_set():
                statuses.append(tenant_a.http.get("/health").status_code)
                done.wait(0.05)

        watcher = threading.Thread(target=watch_health)
        watcher.start()
        try:
            batch_a = tenant_a.create_batch(tenant_a.upload(good[:4] + poison + good[4:])["id"])
            batch_b = tenant_b.create_batch(tenant_b.upload(other)["id"])
            batch_a, batch_b = tenant_a.wait(batch_a["id"]), tenant_b.wait(batch_b["id"])
        finally:
            done.set()
            watcher.join()
        assert statuses and set(statuses) == {200}, "the engine never stopped"
        assert batch_a["status"] == batch_b["status"] == "completed"
        assert batch_a["request_counts"] == {"total": 10, "completed": 9, "failed": 1}
        outputs = {line["custom_id"]: line for line in tenant_a.lines(batch_a["output_file_id"])}
        assert set(outputs) == {f"a{i}" for i in range(8)} | {"huge-top-k"}
        assert all(line["response"]["status_code"] == 200 for line in outputs.values())
        (failed,) = tenant_a.lines(batch_a["error_file_id"])
        assert failed["custom_id"] == "breaks-the-forward"
        assert failed["response"]["status_code"] == 500
        error = failed["response"]["body"]["error"]
        assert (error["type"], error["code"]) == ("server_error", "server_error")
        assert "injected forward fault" in error["message"]
        assert batch_b["request_counts"] == {"total": 10, "completed": 10, "failed": 0}
        assert len(tenant_b.lines(batch_b["output_file_id"])) == 10


def test_a_dead_engine_says_why_keeps_requests_and_cancels(
    serve: Callable[[ASGIApp], AbstractContextManager[str]],
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = tmp_path_factory.mktemp("dead")
    schedule = Scheduler.schedule
    broken = threading.Event()

    def failing(self: Scheduler) -> Any:
        if broken.is_set():
            raise RuntimeError("device lost")
        return schedule(self)

    monkeypatch.setattr(Scheduler, "schedule", failing)
    with _server(serve, storage) as base_url:
        server = LiveServer(base_url=base_url, storage_dir=storage, api_key=KEYS[0])
        broken.set()  # after the model loaded: from now on every step fails, however often the engine restarts
        online = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        waiting: list[Any] = []  # an online call accepted before the engine died is answered, not left waiting
        caller = threading.Thread(target=lambda: waiting.append(server.http.post("/v1/chat/completions", json=online)))
        caller.start()
        batch = server.create_batch(server.upload([chat_line(f"r{i}", max_tokens=4) for i in range(5)])["id"])
        reasons = []  # restarting after each failure, then stopped for good
        for _ in range(300):
            health = server.http.get("/health")
            if health.status_code == 503:
                reasons.append(health.json()["reason"])
                if reasons[-1].startswith("engine stopped"):
                    break
            threading.Event().wait(0.05)
        assert reasons and reasons[-1] == "engine stopped: RuntimeError('device lost')"
        caller.join(10)
        for answer in (*waiting, server.http.post("/v1/chat/completions", json=online)):
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_stopped", answer.text
        assert server.batch(batch["id"])["request_counts"]["failed"] == 0  # nothing failed for the device's sake
        cancelled = server.http.post(f"/v1/batches/{batch['id']}/cancel")
        assert cancelled.status_code == 200
        assert server.wait(batch["id"], timeout_s=10)["status"] == "cancelled"
