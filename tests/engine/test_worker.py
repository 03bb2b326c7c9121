"""EngineWorker: the background thread the server uses."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

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


def _collect(
    worker: EngineWorker, requests: list[EngineRequest], timeout_s: float = 60
) -> tuple[list[str], dict[str, EngineResult]]:
    """Submit ``requests``; once every one is answered, their ids in the order their results came, and the results."""
    order: list[str] = []
    results: dict[str, EngineResult] = {}
    done = threading.Event()

    def on_result(result: EngineResult) -> None:
        order.append(result.request_id)
        results[result.request_id] = result
        if len(results) == len(requests):
            done.set()

    worker.submit(requests, on_result)
    assert done.wait(timeout_s), f"{len(results)} of {len(requests)} answered"
    return order, results


def test_a_request_that_breaks_prepare_or_add_request_fails_alone(
    make_engine: Callable[..., LLMEngine], hf_greedy: Callable[..., list[int]]
) -> None:
    """Whatever a request makes ``prepare`` or ``add_request`` raise is its own answer: no restart, no strike for
    the requests running beside it, nothing left in the engine (fault injection: the two methods raise for it)."""
    engine = make_engine()
    prepare, add_request = engine.prepare, engine.add_request

    def broken_prepare(request: EngineRequest) -> Any:
        if request.request_id == "breaks-prepare":
            raise KeyError("lora_B")
        return prepare(request)

    def broken_add(request: EngineRequest) -> None:
        add_request(request)  # registered first: nothing of it may stay when it then raises
        if request.request_id == "breaks-add":
            raise ZeroDivisionError("r: 0")

    engine.prepare, engine.add_request = broken_prepare, broken_add  # type: ignore[method-assign]
    worker = EngineWorker(engine)
    worker.start()
    try:
        prompts = [[1, 2, 3, 4], [9, 8, 7], [5] * 12]
        requests = [EngineRequest(f"good-{i}", p, SamplingParams(max_tokens=12)) for i, p in enumerate(prompts)]
        requests[1:1] = [EngineRequest("breaks-prepare", [1, 2]), EngineRequest("breaks-add", [3, 4])]
        _, results = _collect(worker, requests)
        for request_id, raised in (("breaks-prepare", "KeyError"), ("breaks-add", "ZeroDivisionError")):
            error = results[request_id].error
            assert error is not None and error.code == "server_error" and raised in error.message
        for i, prompt in enumerate(prompts):
            assert results[f"good-{i}"].outputs[0].token_ids == hf_greedy(prompt, 12)
        assert worker.restarts == 0 and worker.error is None and worker.healthy
        assert not worker._strikes.counts  # nobody was struck
        deadline = time.monotonic() + 10
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished_requests()
    finally:
        worker.stop(timeout=10)


def test_a_grammar_that_compiles_for_seconds_holds_up_neither_the_caller_nor_the_engine(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """Submitting returns before the grammar is compiled; the engine runs what came after it meanwhile."""
    from batchgen.server.serving.structured import json_grammar

    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    grammar = json_grammar(schema, lenient=False)
    engine = make_engine()
    worker = EngineWorker(engine)
    worker.start()
    order: list[str] = []
    results: dict[str, EngineResult] = {}
    done = threading.Event()

    def on_result(result: EngineResult) -> None:
        order.append(result.request_id)
        results[result.request_id] = result
        if len(results) == 4:
            done.set()

    try:
        worker.submit([EngineRequest("schema", [1, 2, 3], SamplingParams(max_tokens=4, grammar=grammar))], on_result)
        assert not engine.grammars.start(grammar).done()  # submit did not compile it
        plain = [EngineRequest(f"plain-{i}", [4, 5, 6 + i], SamplingParams(max_tokens=4)) for i in range(3)]
        worker.submit(plain, on_result)
        assert done.wait(60)
        assert order[-1] == "schema", order  # the others ran while it compiled
        assert all(result.error is None for result in results.values())
        assert len(results["schema"].outputs[0].token_ids) >= 1
    finally:
        worker.stop(timeout=10)


def test_an_idle_engine_asked_about_its_group_never_holds_up_a_submission(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle worker asks its engine whether a rank of its group went (a broken group takes up to a second to say
    which): outside the lock that ``submit`` (called on the server's event loop) takes."""
    engine = make_engine()
    asking = threading.Event()

    def slow_idle_fault() -> None:
        asking.set()
        time.sleep(1.0)  # as RankGroup.failed waits to name the rank that exited

    monkeypatch.setattr(engine, "idle_fault", slow_idle_fault)
    worker = EngineWorker(engine)
    worker.start()
    try:
        assert asking.wait(5)
        started = time.monotonic()
        worker.submit([EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=1))], lambda result: None)
        assert time.monotonic() - started < 0.2
    finally:
        worker.stop(timeout=10)


def test_an_engines_grammar_compiler_goes_with_it(make_engine: Callable[..., LLMEngine]) -> None:
    """The process's compilers are kept while an engine holds them: an engine gone (a restart, another model) leaves
    none behind, nor its tokenizer."""
    import gc

    from batchgen.server.engine.sampling import grammar

    engine = make_engine()
    key = (id(engine.tokenizer), engine.vocab_size)
    assert grammar._COMPILERS[key] is engine.grammars
    del engine
    gc.collect()
    assert key not in grammar._COMPILERS
