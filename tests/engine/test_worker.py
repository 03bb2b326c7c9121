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
        worker.submit(
            [EngineRequest("slow-a", prompts[4], long, group="g"), EngineRequest("slow-b", prompts[5], long)], on_result
        )
        assert done.wait(30)
        worker.abort_group("g")
        worker.abort(["slow-b"])
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


def test_abort_group_calls_back_once_applied(make_engine: Callable[..., LLMEngine]) -> None:
    worker = EngineWorker(make_engine())
    events: list[tuple[str, str]] = []  # (kind, request id or group), in the worker's order
    first_token_steps = threading.Event()
    aborted = threading.Event()
    others_done = threading.Event()
    endless = SamplingParams(max_tokens=100_000, ignore_eos=True)

    def on_result(result: EngineResult) -> None:
        events.append(("result", result.request_id))
        if result.request_id == "other-short":
            first_token_steps.set()
        if result.request_id == "other-long":
            others_done.set()

    def on_aborted() -> None:
        events.append(("aborted", "doomed"))
        aborted.set()

    worker.start()
    try:
        doomed = [EngineRequest(f"doomed-{i}", [1 + i, 2, 3, 4], endless, group="doomed") for i in range(3)]
        doomed.append(EngineRequest("doomed-done", [9, 8, 7], SamplingParams(max_tokens=1), group="doomed"))
        others = [
            EngineRequest("other-short", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), group="other"),
            EngineRequest("other-long", [5, 6, 8], SamplingParams(max_tokens=40, ignore_eos=True), group="other"),
        ]
        worker.submit(doomed + others, on_result)
        assert first_token_steps.wait(30)  # the doomed group is decoding now
        worker.abort_group("doomed", on_aborted)
        assert aborted.wait(30), worker.error
        assert others_done.wait(30), worker.error
        # One more round trip through the worker, so any late result of the group would have been delivered.
        flushed = threading.Event()
        worker.abort_group("nothing", flushed.set)
        assert flushed.wait(30)
    finally:
        worker.stop(timeout=10)
    assert events.count(("aborted", "doomed")) == 1
    after_abort = events[events.index(("aborted", "doomed")) + 1 :]
    assert not [e for e in after_abort if e[1].startswith("doomed")]  # nothing of the group after the callback
    delivered = {request_id for kind, request_id in events if kind == "result"}
    assert {"doomed-0", "doomed-1", "doomed-2"}.isdisjoint(delivered)  # aborted mid-decode: never reported
    assert {"doomed-done", "other-short", "other-long"} <= delivered  # finished before, and the other group
    assert worker.engine.block_manager.num_free_blocks == worker.engine.block_manager.num_blocks
