"""EngineWorker: the background thread the server uses."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from batchgen.server.engine import EngineRequest, EngineResult, EngineWorker, LLMEngine, SamplingParams


def test_worker_runs_requests_reports_from_its_thread_and_aborts(
    make_engine: Callable[..., LLMEngine], random_prompts: Callable[..., Any], hf_greedy: Callable[..., list[int]]
) -> None:
    worker = EngineWorker(make_engine())
    worker.start()
    prompts = random_prompts(6, 5, 30, seed=30)
    results: dict[str, EngineResult] = {}
    threads: set[str] = set()
    done = threading.Event()

    def on_result(result: EngineResult) -> None:
        threads.add(threading.current_thread().name)
        results[result.request_id] = result
        if len(results) == 4:
            done.set()

    try:
        worker.submit(
            [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=8)) for i, p in enumerate(prompts[:4])], on_result
        )
        long = SamplingParams(max_tokens=100_000, ignore_eos=True)
        worker.submit([EngineRequest("slow-a", prompts[4], long), EngineRequest("slow-b", prompts[5], long)], on_result)
        assert done.wait(30)
        worker.abort(["slow-a", "slow-b"])
        deadline = time.monotonic() + 10
        while worker.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not worker.engine.has_unfinished_requests()
        for i in range(4):
            assert results[f"r{i}"].outputs[0].token_ids == hf_greedy(prompts[i], 8)
        assert set(results) == {"r0", "r1", "r2", "r3"}  # aborted requests report nothing
        assert threads == {"batchgen-engine"}
        stats = worker.stats()
        assert stats.running == 0 and stats.queued == 0 and stats.kv_blocks_free == stats.kv_blocks_total

        # Idle: the thread waits on a condition instead of spinning.
        before = time.process_time()
        time.sleep(0.5)
        assert time.process_time() - before < 0.1
        assert worker.healthy
    finally:
        worker.stop(timeout=10)
    assert not worker.healthy and worker.error is None


def test_worker_reports_a_dead_loop(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    worker = EngineWorker(engine)

    def broken_step() -> list[EngineResult]:
        raise RuntimeError("device lost")

    engine.step = broken_step  # type: ignore[method-assign]  # fault injection: a step that fails
    worker.start()
    worker.submit([EngineRequest("x", [1, 2, 3])], lambda result: None)
    deadline = time.monotonic() + 10
    while worker.healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.healthy
    assert isinstance(worker.error, RuntimeError)
