"""Interactive (online) requests go ahead of batch work: admitted first, preempting a batch sequence for room; and a
step carrying their decodes takes a bounded number of prefill tokens (``StepCosts``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from batchgen.server.engine.step_costs import StepCosts

Run = Callable[..., Any]
LONG = SamplingParams(max_tokens=40, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, ignore_eos=True)


def _finish(engine: LLMEngine) -> dict[str, list[int]]:
    """Step until idle: each request's tokens, in the order the requests finished."""
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({result.request_id: result.outputs[0].token_ids for result in engine.step()})
    return finished


def _batch(prompts: list[list[int]]) -> list[EngineRequest]:
    return [EngineRequest(f"b{i}", prompt, LONG) for i, prompt in enumerate(prompts)]


def test_an_interactive_request_preempts_a_full_running_set_and_finishes_first(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run
) -> None:
    prompts = random_prompts(5, 10, 30, seed=30)
    alone = run_to_completion(make_engine(max_num_seqs=4), _batch(prompts[:4]))
    engine = make_engine(max_num_seqs=4)
    for request in _batch(prompts[:4]):
        engine.add_request(request)
    for _ in range(3):
        engine.step()
    assert engine.stats().running == 4
    engine.add_request(EngineRequest("online", prompts[4], SHORT, interactive=True))
    engine.step()
    stats = engine.stats()
    assert (stats.running, stats.queued, stats.preemptions) == (4, 1, 1)
    assert "online" in {seq.state.request.request_id for seq in engine.scheduler.running}
    finished = _finish(engine)
    assert next(iter(finished)) == "online" and sorted(finished) == ["b0", "b1", "b2", "b3", "online"]
    # The preempted sequence was computed again: every batch output is what it is without the online request.
    assert {k: v for k, v in finished.items() if k != "online"} == {k: r.outputs[0].token_ids for k, r in alone.items()}


def test_interactive_requests_wait_ahead_of_queued_batch_ones(
    make_engine: Callable[..., LLMEngine], random_prompts: Run
) -> None:
    prompts = random_prompts(6, 5, 20, seed=31)
    engine = make_engine(max_num_seqs=2)
    for request in _batch(prompts[:4]):
        engine.add_request(request)
    engine.step()
    for i, prompt in enumerate(prompts[4:]):
        engine.add_request(EngineRequest(f"online{i}", prompt, SHORT, interactive=True))
    assert [seq.state.request.request_id for seq in engine.scheduler.waiting] == ["online0", "online1", "b2", "b3"]
    order = list(_finish(engine))
    assert order[:2] == ["online0", "online1"] and sorted(order[2:]) == ["b0", "b1", "b2", "b3"]


def test_an_interactive_request_takes_kv_blocks_from_batch_work(
    make_engine: Callable[..., LLMEngine], random_prompts: Run
) -> None:
    engine = make_engine(num_kv_blocks=8, block_size=16, enable_prefix_caching=False)
    for request in _batch(random_prompts(2, 60, 60, seed=32)):
        engine.add_request(request)
    engine.step()
    assert engine.stats().kv_blocks_free == 0
    engine.add_request(EngineRequest("online", random_prompts(1, 20, 20, seed=33)[0], SHORT, interactive=True))
    engine.step()
    assert "online" in {seq.state.request.request_id for seq in engine.scheduler.running}
    assert engine.stats().preemptions >= 1
    assert next(iter(_finish(engine))) == "online"


def _given(engine: LLMEngine) -> dict[str, int]:
    """The tokens the next step gives each request (scheduled, not run)."""
    return {item.seq.state.request.request_id: item.num_tokens for item in engine.scheduler.schedule().scheduled}


def test_a_step_with_online_decodes_takes_a_bounded_prefill(
    make_engine: Callable[..., LLMEngine], random_prompts: Run
) -> None:
    prompts = random_prompts(4, 100, 100, seed=34)
    engine = make_engine(max_num_batched_tokens=512, block_size=16)
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(EngineRequest(f"online{i}", prompt, LONG, interactive=True))
    engine.step()  # the two prompts, nothing decoding: the whole budget
    engine.add_request(EngineRequest("batch", prompts[2], LONG))
    engine.add_request(EngineRequest("online2", prompts[3], LONG, interactive=True))
    # A decode 2 ms, a prefill token 0.1 ms: beside 2 decodes, a 1.5x step takes 0.5 * 2 * 2 / 0.1 = 20 tokens.
    engine.step_costs.decode_s, engine.step_costs.prefill_token_s = 2e-3, 1e-4
    assert _given(engine) == {"online0": 1, "online1": 1, "online2": 20}


def test_prefills_beside_batch_decodes_or_unmeasured_costs_are_not_bounded(
    make_engine: Callable[..., LLMEngine], random_prompts: Run
) -> None:
    prompts = random_prompts(3, 100, 100, seed=35)
    engine = make_engine(max_num_batched_tokens=512)
    engine.add_request(EngineRequest("batch0", prompts[0], LONG))
    engine.step()
    engine.add_request(EngineRequest("online", prompts[1], LONG, interactive=True))
    engine.add_request(EngineRequest("batch1", prompts[2], LONG))
    engine.step_costs.decode_s, engine.step_costs.prefill_token_s = 2e-3, 1e-4
    # Only a batch sequence decodes: an online prompt and a batch one take what the budget allows.
    assert _given(engine) == {"batch0": 1, "online": 100, "batch1": 100}


def test_step_costs_are_learned_from_step_times() -> None:
    costs = StepCosts(ratio=1.5, floor=16)
    assert costs.prefill_budget(8) is None  # nothing measured: no bound
    costs.record(0.016, decodes=8, prefill=0)  # a decode: 2 ms
    costs.record(0.016 + 0.1, decodes=8, prefill=1000)  # a prefill token: 0.1 ms beyond the decodes
    assert (costs.decode_s, costs.prefill_token_s) == pytest.approx((2e-3, 1e-4))
    assert costs.prefill_budget(8) == 80  # 8 decodes' 16 ms, half of it more: 8 ms of prefill
    assert costs.prefill_budget(1) == 16  # 10 by the ratio: the floor
    costs.record(0.032 + 0.01, decodes=8, prefill=10)  # too few prefill tokens to tell their cost: not counted
    costs.record(0.032, decodes=8, prefill=0)  # a slower decode moves the average a fifth of the way
    assert costs.decode_s == pytest.approx(2.4e-3) and costs.prefill_token_s == 1e-4
    assert StepCosts(ratio=1.0, floor=16).prefill_budget(8) is None
    assert "give 1" in (EngineConfig(max_mixed_step_ratio=0.5).usage_problem() or "")
