"""Streamed requests: each step's new tokens and text as partial results, adding up to the unstreamed output."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from batchgen.server.engine import EngineRequest, EngineResult, EngineWorker, LLMEngine, SamplingParams
from batchgen.server.engine.core.scheduler import Scheduler

Run = Callable[..., Any]


def _run(engine: LLMEngine, request: EngineRequest) -> tuple[list[EngineResult], EngineResult]:
    """The partial results of ``request``, and its final result."""
    engine.add_request(request)
    partial = []
    while engine.has_unfinished_requests():
        for result in engine.step():
            if not result.finished:
                partial.append(result)
            else:
                return partial, result
    raise AssertionError("no final result")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, ignore_eos=True),
        SamplingParams(max_tokens=40, ignore_eos=True, stop=("ed", "q u")),
        SamplingParams(max_tokens=16, ignore_eos=True, n=2, temperature=1.0, seed=3, logprobs=True),
        SamplingParams(max_tokens=30),
    ],
    ids=["plain", "stop-strings", "n2-logprobs", "eos"],
)
def test_partial_results_add_up_to_the_unstreamed_output(
    make_engine: Callable[..., LLMEngine], random_prompts: Run, params: SamplingParams
) -> None:
    engine = make_engine()
    for prompt in [list(b"Once upon a time"), *random_prompts(3, 4, 30, seed=40)]:
        _, plain = _run(engine, EngineRequest("plain", prompt, params))
        partial, final = _run(engine, EngineRequest("streamed", prompt, params, stream=True))
        assert [(o.token_ids, o.text, o.finish_reason) for o in final.outputs] == [
            (o.token_ids, o.text, o.finish_reason) for o in plain.outputs
        ]
        tokens: dict[int, list[int]] = defaultdict(list)
        text: dict[int, str] = defaultdict(str)
        for result in partial:
            assert result.request_id == "streamed" and result.prompt_tokens == len(prompt)
            for output in result.outputs:
                assert not any(stop in output.text for stop in params.stop)
                tokens[output.index] += output.token_ids
                text[output.index] += output.text
                if params.logprobs:
                    assert [lp.token_id for lp in output.logprobs or []] == output.token_ids
        assert len(partial) >= min(len(o.token_ids) for o in final.outputs) - 1  # a result per step
        for output in final.outputs:
            assert output.token_ids[: len(tokens[output.index])] == tokens[output.index]
            assert output.text.startswith(text[output.index])


def test_a_choice_that_ends_early_reports_its_end_at_once(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    for seed in range(50):  # a seed with which one choice stops before the other
        params = SamplingParams(max_tokens=20, n=2, temperature=1.5, seed=seed, stop=("e", "a", "o"))
        partial, final = _run(engine, EngineRequest("r", list(b"The tree here"), params, stream=True))
        if len({len(o.token_ids) for o in final.outputs}) == 2:
            break
    else:
        pytest.fail("no seed made the choices end apart")
    ended = [o for result in partial for o in result.outputs if o.finish_reason is not None]
    assert len(ended) == 1 and ended[0].finish_reason == final.outputs[ended[0].index].finish_reason


def test_the_worker_streams_and_fails_a_streamed_request_it_cannot_continue(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an engine restart a streamed request that reported tokens gets an error; the others run again."""
    schedule = Scheduler.schedule
    failed = threading.Event()

    def fail_once_mid_stream(self: Scheduler) -> Any:
        output = schedule(self)
        if not failed.is_set() and any(item.seq.num_generated >= 3 for item in output.scheduled):
            failed.set()
            raise RuntimeError("injected scheduler fault")
        return output

    worker = EngineWorker(make_engine())
    monkeypatch.setattr(Scheduler, "schedule", fail_once_mid_stream)
    received: dict[str, list[EngineResult]] = defaultdict(list)
    done = threading.Event()

    def on_result(result: EngineResult) -> None:
        received[result.request_id].append(result)
        if sum(r.finished for results in received.values() for r in results) == 2:
            done.set()

    params = SamplingParams(max_tokens=10, ignore_eos=True)
    worker.start()
    try:
        worker.submit(
            [
                EngineRequest("streamed", list(b"Hello"), params, stream=True, interactive=True),
                EngineRequest("plain", list(b"Hello"), params),
            ],
            on_result,
        )
        assert done.wait(30)
    finally:
        worker.stop(timeout=10)
    assert worker.restarts == 1
    *partial, final = received["streamed"]
    assert partial and not any(r.finished for r in partial)
    assert final.error is not None and final.error.code == "server_error" and "streamed" in final.error.message
    [plain] = received["plain"]
    assert plain.error is None and plain.completion_tokens == 10
