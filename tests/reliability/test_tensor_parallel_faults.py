"""``--tensor-parallel-size 2`` over the real API: a batch served by a model split over two ranks; a rank killed
(SIGKILL, as the OOM killer would) while the batch runs is noticed at once (its peer's collective fails, no
timeout waited for), ``/health`` says the engine restarts and why, ``/metrics`` counts the restart, the group starts
again, and every line of the batch is answered exactly once, none failed. A rank killed while the engine is idle is
noticed within a second or two, and the group is back before the next request."""

from __future__ import annotations

import atexit
import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from litestar.types import ASGIApp
from server_helpers import LiveServer, chat_line

from batchgen.server.app import create_app
from batchgen.server.engine.config import EngineConfig
from batchgen.server.engine.distributed import group as group_module
from batchgen.server.settings import Settings

LINES = 6


def _ranks() -> list[int]:
    """This process's worker ranks (the in-process server is the driver, rank 0)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent == os.getpid() and b"engine.distributed.rank" in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.mark.slow  # a group started twice, and the struck lines run again on probation, one at a time
def _kill_and_watch(server: LiveServer, rank: int) -> list[str]:
    """Kill ``rank``; ``/health``'s reasons while it answers 503, until it is healthy again."""
    killed = time.monotonic()
    os.kill(rank, signal.SIGKILL)
    reasons: list[str] = []
    while time.monotonic() < killed + 60:
        health = server.http.get("/health")
        if health.status_code == 503:
            reasons.append(health.json()["reason"])
        elif reasons:
            return reasons  # back
        time.sleep(0.02)
    raise AssertionError(f"the group was not back within 60 s: {reasons}")


def _exit_hooks(monkeypatch: pytest.MonkeyPatch) -> set[object]:
    """The groups' exit hooks registered and not unregistered, as they come and go."""
    hooks: set[object] = set()

    class Recording:
        def register(self, hook: Callable[[], None]) -> None:
            hooks.add(hook)
            atexit.register(hook)

        def unregister(self, hook: Callable[[], None]) -> None:
            hooks.discard(hook)
            atexit.unregister(hook)

    monkeypatch.setattr(group_module, "atexit", Recording())
    return hooks


def test_a_killed_rank_restarts_the_group_and_every_line_is_answered_once(
    serve: Callable[[ASGIApp], AbstractContextManager[str]],
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = tmp_path_factory.mktemp("tp")
    engine = EngineConfig(torch_threads=1, cpu_kv_cache_gib=0.0625, tensor_parallel_size=2, distributed_timeout_s=20)
    settings = Settings(storage_dir=storage, flush_interval_s=0.05, engine=engine)
    exit_hooks = _exit_hooks(monkeypatch)
    with serve(create_app(settings)) as base_url:
        server = LiveServer(base_url=base_url, storage_dir=storage)
        (rank,) = _ranks()
        lines = [chat_line(f"r{i}", content=f"question {i}", max_tokens=16, ignore_eos=True) for i in range(LINES)]
        batch = server.create_batch(server.upload(lines)["id"])
        while server.http.get("/v1/pool/status").json()["generated_tokens"] < 12:
            time.sleep(0.01)  # the batch is running
        reasons = _kill_and_watch(server, rank)
        assert reasons[0] == (
            "engine restarting after a failure: GroupFailed('the tensor-parallel group of 2 ranks failed: "
            "rank 1 exited (signal 9)')"
        )
        (rank,) = _ranks()  # a new rank 1
        done = server.wait(batch["id"], timeout_s=120)
        assert done["status"] == "completed"
        assert done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
        outputs = server.lines(done["output_file_id"])
        assert sorted(line["custom_id"] for line in outputs) == sorted(f"r{i}" for i in range(LINES))  # once each
        assert all(line["response"]["body"]["usage"]["completion_tokens"] == 16 for line in outputs)
        # Killed while the engine is idle: seen within a second or two, not at the next request.
        assert "exited (signal 9)" in _kill_and_watch(server, rank)[0]
        metrics = server.http.get("/metrics").text.splitlines()
        assert [line for line in metrics if line.startswith("batchgen_engine_restarts")] == [
            'batchgen_engine_restarts_total{model_name="demo"} 2.0'
        ]
        assert len(exit_hooks) == 1  # the live group's: a dead group's went with it
        # n > 1 forks copy their block in the new group (the scheduler held the dead runner's copy).
        chat = [{"role": "user", "content": "fork me, then"}]  # 37 tokens: a partly filled block, copied
        body = {"model": "demo", "messages": chat, "max_tokens": 8}
        one = server.http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        two = server.http.post("/v1/chat/completions", json={**body, "n": 2}).json()["choices"]
        assert [choice["message"]["content"] for choice in two] == [one, one]
