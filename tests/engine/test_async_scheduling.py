"""Async scheduling: each step is launched before the previous one's tokens are read back, its inputs taking those
tokens on the device. Outputs must be exactly those of one step at a time, whatever the requests ask for; the steps
must really overlap; and nothing a step computes for a sequence that ended meanwhile may leak into a result.

On CPU the device is the host, so nothing runs concurrently: what these tests check is the bookkeeping (pending
tokens, the one-step delay, tokens read from the device), which is the same on CUDA.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from batchgen.server.engine import EngineRequest, EngineResult, LLMEngine, SamplingParams
from batchgen.server.engine.errors import ModelLoadError
from batchgen.server.engine.ops.transfer import HostCopy
from batchgen.server.engine.runner.inputs import InputBuffers, StepInputs
from batchgen.server.engine.runner.launched import Launched
from batchgen.server.engine.sampling.sampler import Sampled
from batchgen.server.engine.scheduler_output import ScheduledSeq
from batchgen.server.engine.sequence import PENDING

Run = Callable[..., dict[str, EngineResult]]


def _mixed_requests(prompts: list[list[int]]) -> list[EngineRequest]:
    """Every kind of request the bookkeeping treats differently."""
    kinds = [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=20),  # may end on EOS
        SamplingParams(max_tokens=16, temperature=1.0, seed=3, logprobs=True, top_logprobs=2),
        SamplingParams(max_tokens=14, ignore_eos=True, stop=("e", "a b")),
        SamplingParams(max_tokens=10, ignore_eos=True, n=3, temperature=0.8, seed=5),
        SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=0.7, repetition_penalty=1.3),
        SamplingParams(max_tokens=9, min_tokens=6, stop_token_ids=(7, 9, 11, 13), temperature=1.0, seed=6),
        SamplingParams(max_tokens=1, ignore_eos=True),
        SamplingParams(max_tokens=15, ignore_eos=True, logit_bias={65: 4.0}),
    ]
    requests = [EngineRequest(f"r{i}", p, kinds[i % len(kinds)]) for i, p in enumerate(prompts)]
    requests += [
        EngineRequest("embed-0", prompts[0], task="embed"),
        EngineRequest("embed-1", prompts[-1], task="embed"),
    ]
    requests += [EngineRequest("stream", prompts[1], SamplingParams(max_tokens=11, ignore_eos=True), stream=True)]
    return requests


def _outputs(results: dict[str, EngineResult]) -> dict[str, Any]:
    def logprobs(output: Any) -> Any:
        return None if output.logprobs is None else [(lp.token_id, round(lp.logprob, 9)) for lp in output.logprobs]

    return {
        rid: (
            [(o.index, o.token_ids, o.text, o.finish_reason, logprobs(o)) for o in r.outputs],
            None if r.embedding is None else np.round(r.embedding, 9).tolist(),
            r.error,
        )
        for rid, r in results.items()
    }


def _run_streaming(engine: LLMEngine, requests: list[EngineRequest]) -> tuple[dict[str, EngineResult], list[int]]:
    """Final results by id, and the token ids the streamed request's partial results reported (all but what the
    last step added, which comes with the final result)."""
    for request in requests:
        engine.add_request(request)
    results: dict[str, EngineResult] = {}
    streamed: list[int] = []
    while engine.has_unfinished_requests():
        for result in engine.step():
            if result.finished:
                results[result.request_id] = result
            else:
                streamed += result.outputs[0].token_ids
    return results, streamed


@pytest.mark.parametrize(
    "limits",
    [
        {},
        {"max_num_batched_tokens": 24, "block_size": 4},  # prompts prefilled in chunks, decodes beside them
        {"num_kv_blocks": 40, "block_size": 4, "max_num_seqs": 6},  # preemption: sequences recomputed
    ],
    ids=["roomy", "chunked", "preempting"],
)
def test_outputs_are_those_of_one_step_at_a_time(
    make_engine: Callable[..., LLMEngine], random_prompts: Callable[..., list[list[int]]], limits: dict[str, Any]
) -> None:
    prompts = random_prompts(18, 3, 40, seed=11)
    prompts[2] = [*prompts[0][:30], 5, 6]  # shares a prefix with another prompt: prefix-cache hits
    engines = {mode: make_engine(async_scheduling=mode, **limits) for mode in ("off", "on")}
    runs = {mode: _run_streaming(engine, _mixed_requests(prompts)) for mode, engine in engines.items()}
    (sync_results, sync_streamed), (async_results, async_streamed) = runs["off"], runs["on"]
    assert _outputs(async_results) == _outputs(sync_results)
    final = async_results["stream"].outputs[0].token_ids
    assert async_streamed == sync_streamed == final[: len(async_streamed)] and len(async_streamed) >= len(final) - 1
    assert all(PENDING not in o.token_ids for r in async_results.values() for o in r.outputs)
    if "num_kv_blocks" in limits:
        assert engines["on"].stats().preemptions > 0 and engines["off"].stats().preemptions > 0
    for engine in engines.values():  # nothing left behind: no sequence, no step in flight, every block free
        assert not engine.has_unfinished_requests() and engine._in_flight is None
        assert not engine.scheduler.running and not engine.scheduler.waiting
        assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_steps_overlap_and_take_their_inputs_from_the_device(
    make_engine: Callable[..., LLMEngine], random_prompts: Callable[..., list[list[int]]], run_to_completion: Run
) -> None:
    """Each decode step is launched while the previous one is in flight (the host has not read its tokens), and the
    decodes' input tokens come from that step's output on the device."""
    engine = make_engine(async_scheduling="on")
    events: list[str] = []
    from_device: list[int] = []
    start, settle, prepare = engine._start, engine._settle, engine.runner.inputs.prepare

    def spy_start(scheduled: list[ScheduledSeq]) -> Any:
        events.append("launch" if engine._in_flight is None else "launch while one is in flight")
        return start(scheduled)

    def spy_settle(finished: list[EngineResult]) -> None:
        events.append("settle")
        settle(finished)

    def spy_prepare(*args: Any) -> StepInputs:
        step = prepare(*args)
        from_device.append(0 if step.from_device is None else len(step.from_device.rows))
        return step

    engine._start, engine._settle, engine.runner.inputs.prepare = spy_start, spy_settle, spy_prepare  # type: ignore[method-assign]
    prompts = random_prompts(4, 5, 20, seed=3)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    results = run_to_completion(engine, [EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    assert [len(r.outputs[0].token_ids) for r in results.values()] == [10] * 4
    # The prefill step, then 9 decode steps, each launched before its predecessor is read. The last samples the
    # sequences' last tokens (by max_tokens: known at launch), so no step follows it for nothing.
    assert events[:3] == ["launch", "launch while one is in flight", "settle"]
    assert events.count("launch while one is in flight") == 9 and events.count("settle") == 10
    assert from_device == [0] + [4] * 9


def test_generated_tokens_reach_the_prefix_cache(
    make_engine: Callable[..., LLMEngine], random_prompts: Callable[..., list[list[int]]], run_to_completion: Run
) -> None:
    """The blocks a step fills are published once its tokens are read, under their real tokens: a follow-up whose
    prompt is an earlier request's prompt and output (a chat's next turn) finds it cached, all but the last token
    (never an input, so its block is not full: 10 blocks of 4)."""
    prompt = random_prompts(1, 21, 21, seed=4)[0]
    params = SamplingParams(max_tokens=23, ignore_eos=True)
    for mode in ("off", "on"):
        engine = make_engine(async_scheduling=mode, block_size=4)
        first = run_to_completion(engine, [EngineRequest("first", prompt, params)])["first"]
        history = prompt + first.outputs[0].token_ids  # 44 tokens: the blocks of 4 fill in decode steps
        second = run_to_completion(engine, [EngineRequest("second", [*history, 1, 2], params)])["second"]
        assert second.cached_tokens == 40, mode


def test_device_tokens_fill_the_inputs_the_host_has_not_read(make_engine: Callable[..., LLMEngine]) -> None:
    """Inputs packed with pending tokens taken from the device equal those packed from the tokens themselves."""
    engine = make_engine()
    rng = random.Random(0)
    for i in range(3):
        engine.add_request(EngineRequest(f"r{i}", [rng.randrange(256) for _ in range(9 + i)], SamplingParams()))
    output = engine.scheduler.schedule()
    engine.runner.update_states(output)
    for item in output.scheduled:  # as after a step: prompts computed but their last token, which is sampled
        item.seq.num_computed_tokens = len(item.seq) - 1
    known = [ScheduledSeq(item.seq, 1) for item in output.scheduled]
    buffers = InputBuffers(64, engine.config.block_size, torch.device("cpu"))
    sampled = torch.tensor([0, 41, 0, 42, 43])  # the step in flight's tokens: rows 1, 3, 4
    in_flight = Launched(known, token_rows={item.seq: row for item, row in zip(known, [1, 3, 4], strict=True)})
    in_flight.sampled = Sampled(sampled, HostCopy(sampled), 5, np.zeros(0, np.int64), np.zeros(0, np.int64), 0)
    expected = [41, 42, 43]
    for item, token in zip(known, expected, strict=True):
        item.seq.token_ids[-1] = token
    tables = engine.scheduler.block_manager.tables.array
    plain = buffers.prepare(known, tables, engine.runner.batch).packed
    plain_ids = plain.input_ids.clone()
    for item in known:
        item.seq.token_ids[-1] = PENDING
    filled = buffers.prepare(known, tables, engine.runner.batch, in_flight).packed
    assert filled.input_ids.tolist() == plain_ids.tolist() == expected
    assert torch.equal(filled.positions, plain.positions) and torch.equal(filled.slots, plain.slots)
    engine.reset()


def test_a_request_aborted_while_its_step_runs_reports_nothing(
    make_engine: Callable[..., LLMEngine], random_prompts: Callable[..., list[list[int]]]
) -> None:
    engine = make_engine(async_scheduling="on")
    prompts = random_prompts(3, 5, 20, seed=8)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    results: dict[str, EngineResult] = {}
    for _ in range(4):
        results.update((r.request_id, r) for r in engine.step())
    assert engine._in_flight is not None  # r1's step is running
    assert engine.abort_request("r1")
    while engine.has_unfinished_requests():
        results.update((r.request_id, r) for r in engine.step())
    assert sorted(results) == ["r0", "r2"]
    reference = make_engine()
    for i in (0, 2):
        reference.add_request(EngineRequest(f"r{i}", prompts[i], params))
    while reference.has_unfinished_requests():
        for result in reference.step():
            assert result.outputs[0].token_ids == results[result.request_id].outputs[0].token_ids
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_async_scheduling_is_on_for_cuda_only_unless_asked(make_engine: Callable[..., LLMEngine]) -> None:
    assert make_engine().async_scheduling is False  # auto, on CPU
    assert make_engine(async_scheduling="on").async_scheduling is True
    with pytest.raises(ModelLoadError, match="--async-scheduling"):
        make_engine(async_scheduling="sometimes")


def test_a_step_the_device_fails_names_its_own_requests(
    make_engine: Callable[..., LLMEngine],
    random_prompts: Callable[..., list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading a step back fails (the device failed running it) after the next one was launched: the suspects the
    worker strikes are that step's requests, not the next one's newcomers."""
    engine = make_engine(async_scheduling="on")
    first, second = random_prompts(2, 5, 10, seed=9)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request(EngineRequest("early", first, params))
    engine.step()  # its prefill is in flight
    engine.add_request(EngineRequest("late", second, params))

    def device_fault(self: Sampled) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(Sampled, "read", device_fault)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.step()  # launches early's decode and late's prefill, then reads early's prefill back
    assert engine.suspects() == ["early"]
