"""No request can stop the engine: a fault is pinned on the request that causes it, and everyone else's output is
exactly what it would have been without it.

A grammar-constrained request is among the good ones: its matcher must come through the bisection unharmed.

Faults are injected by patching the engine's own classes for requests that carry a marker (a stop string or a seed),
the only fake in these tests: the engine, the model and the worker are real.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from llguidance import LLMatcher

from batchgen.server.engine import EngineRequest, EngineResult, EngineWorker, LLMEngine, SamplingParams
from batchgen.server.engine.core.scheduler import Scheduler
from batchgen.server.engine.runner.model_runner import ModelRunner
from batchgen.server.engine.sampling.sampler import Sampler
from batchgen.server.engine.sampling.seeds import int64_bits, mix64
from batchgen.server.engine.worker import MAX_RESTARTS

FORWARD_FAULT = "<forward-fault>"
SAMPLER_FAULT_SEED = 13013
SCHEDULER_FAULT = "<scheduler-fault>"


def _good_requests(prompts: list[list[int]]) -> list[EngineRequest]:
    kinds = [
        SamplingParams(max_tokens=6),
        SamplingParams(max_tokens=6, temperature=1.0, seed=7),
        SamplingParams(max_tokens=6, temperature=0.9, top_k=2147483647, seed=8),  # top_k far past the vocabulary
        SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=9, logprobs=True, top_logprobs=3),
        SamplingParams(max_tokens=6, temperature=1.0, seed=10, grammar=LLMatcher.grammar_from_regex("[a-z]{2,9}")),
    ]
    return [EngineRequest(f"good-{i}", p, kinds[i % len(kinds)]) for i, p in enumerate(prompts)]


def _outputs(results: dict[str, EngineResult]) -> dict[str, Any]:
    return {rid: [(o.token_ids, o.text) for o in r.outputs] for rid, r in results.items() if rid.startswith("good")}


@pytest.fixture
def prompts(random_prompts: Callable[..., list[list[int]]]) -> list[list[int]]:
    return random_prompts(12, 3, 40, seed=5)


@pytest.fixture
def clean(
    make_engine: Callable[..., LLMEngine], prompts: list[list[int]], run_to_completion: Callable[..., Any]
) -> dict[str, Any]:
    """The good requests' outputs with no fault anywhere."""
    return _outputs(run_to_completion(make_engine(), _good_requests(prompts)))


@pytest.fixture
def injected_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Forward and sampler raise for marked requests; the scheduler (outside the engine's own fault isolation)
    raises while a marked request is scheduled, ``calls`` times at most (all of them by default)."""
    scheduler_faults = {"left": 10**9}
    execute, sample, schedule = ModelRunner.execute, Sampler.launch, Scheduler.schedule

    def faulty_forward(self: ModelRunner, scheduled: list[Any], *args: Any) -> Any:
        if any(FORWARD_FAULT in item.seq.state.request.params.stop for item in scheduled):
            raise RuntimeError("injected forward fault")
        return execute(self, scheduled, *args)

    def faulty_sample(self: Sampler, logits: Any, rows: Any) -> Any:
        if int64_bits(mix64(SAMPLER_FAULT_SEED, 0)) in rows.seeds:  # the marked request's choice
            raise ValueError("injected sampler fault")
        return sample(self, logits, rows)

    def faulty_schedule(self: Scheduler) -> Any:
        output = schedule(self)
        if scheduler_faults["left"] and any(
            SCHEDULER_FAULT in item.seq.state.request.params.stop for item in output.scheduled
        ):
            scheduler_faults["left"] -= 1
            raise RuntimeError("injected scheduler fault")
        return output

    monkeypatch.setattr(ModelRunner, "execute", faulty_forward)
    monkeypatch.setattr(Sampler, "launch", faulty_sample)
    monkeypatch.setattr(Scheduler, "schedule", faulty_schedule)
    yield scheduler_faults


def _poison(rid: str, **params: Any) -> EngineRequest:
    return EngineRequest(rid, [5, 6, 7, 8, 9], SamplingParams(max_tokens=6, **params))


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_failing_request_fails_alone(
    make_engine: Callable[..., LLMEngine],
    prompts: list[list[int]],
    clean: dict[str, Any],
    injected_faults: dict[str, int],
    run_to_completion: Callable[..., Any],
    async_scheduling: str,
) -> None:
    """The poisoned requests arrive while the good ones decode: with async scheduling, a step then fails to launch
    while another is in flight, which is settled first; the failing step is isolated as before."""
    poison = [
        _poison("bad-forward", stop=(FORWARD_FAULT,)),
        _poison("bad-sampler", temperature=1.0, seed=SAMPLER_FAULT_SEED),
    ]
    good = _good_requests(prompts)
    engine = make_engine(async_scheduling=async_scheduling)
    for request in good:
        engine.add_request(request)
    early = engine.step() + engine.step()
    assert (engine._in_flight is not None) == (async_scheduling == "on")
    results = {result.request_id: result for result in early} | run_to_completion(engine, poison)
    assert _outputs(results) == clean  # token for token, sampled requests included
    for rid, fault in (("bad-forward", "injected forward fault"), ("bad-sampler", "injected sampler fault")):
        error = results[rid].error
        assert error is not None and error.code == "server_error" and fault in error.message


def _run_worker(worker: EngineWorker, requests: list[EngineRequest]) -> dict[str, EngineResult]:
    results: dict[str, EngineResult] = {}
    done = threading.Event()

    def on_result(result: EngineResult) -> None:
        results[result.request_id] = result
        if len(results) == len(requests):
            done.set()

    worker.submit(requests, on_result)
    assert done.wait(60), (worker.state, worker.error)
    return results


def test_the_worker_restarts_the_engine_and_quarantines_what_fails_twice(
    make_engine: Callable[..., LLMEngine],
    prompts: list[list[int]],
    clean: dict[str, Any],
    injected_faults: dict[str, int],
) -> None:
    worker = EngineWorker(make_engine())
    worker.start()
    try:
        results = _run_worker(worker, [_poison("bad-scheduler", stop=(SCHEDULER_FAULT,)), *_good_requests(prompts)])
        assert worker.restarts == 2 and worker.state == "running" and worker.healthy
    finally:
        worker.stop(timeout=10)
    assert _outputs(results) == clean  # nothing lost, nothing changed by the restarts
    error = results["bad-scheduler"].error
    assert error is not None and error.code == "server_error" and "two times the engine failed" in error.message


def test_a_one_off_engine_failure_loses_nothing(
    make_engine: Callable[..., LLMEngine],
    prompts: list[list[int]],
    clean: dict[str, Any],
    injected_faults: dict[str, int],
) -> None:
    injected_faults["left"] = 1
    worker = EngineWorker(make_engine())
    worker.start()
    try:
        results = _run_worker(worker, [_poison("flaky", stop=(SCHEDULER_FAULT,)), *_good_requests(prompts)])
    finally:
        worker.stop(timeout=10)
    assert _outputs(results) == clean
    assert results["flaky"].error is None and worker.restarts == 1


def test_an_engine_that_keeps_failing_stops_and_fails_nothing(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]
) -> None:
    """A broken device: after MAX_RESTARTS the worker gives up, answering nothing (nothing is failed for the
    device's sake: a new process runs the requests), and says why."""

    def broken(self: Scheduler) -> Any:
        raise RuntimeError("device lost")

    worker = EngineWorker(make_engine())
    monkeypatch.setattr(Scheduler, "schedule", broken)
    answered: list[EngineResult] = []
    worker.start()
    try:
        worker.submit(_good_requests(prompts), answered.append)
        worker._thread.join(30)
        assert worker.state == "dead" and not worker.healthy and "device lost" in repr(worker.error)
        assert worker.restarts == MAX_RESTARTS and answered == []
    finally:
        worker.stop(timeout=10)
