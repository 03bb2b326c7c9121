"""Interactive (online) requests go ahead of batch work: admitted first, preempting a batch sequence for room; and a
step carrying their decodes takes a bounded number of prefill tokens (``StepCosts``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from batchgen.server.engine.core.step_costs import SMOOTHING, StepCosts

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


def _measured(ratio: float = 1.5) -> StepCosts:
    """Costs as if measured: a step of ``d`` decodes alone 2 + 2d ms, a prefill token 0.11 ms."""
    costs = StepCosts(ratio, floor=16)
    costs.record(0.006, decodes=2, prefill=0)
    costs.record(0.010, decodes=4, prefill=0)
    costs.record(0.006 + 0.011, decodes=2, prefill=100)
    return costs


def _given(engine: LLMEngine, costs: StepCosts) -> dict[str, int]:
    """The tokens the next step gives each request, with these costs (scheduled, not run)."""
    engine.scheduler.step_costs = costs
    return {item.seq.state.request.request_id: item.num_tokens for item in engine.scheduler.schedule().scheduled}


def _streaming(make_engine: Callable[..., LLMEngine], prompts: list[list[int]], streams: int) -> LLMEngine:
    """An engine whose first ``streams`` prompts are online streams past their prefill (decoding)."""
    engine = make_engine(max_num_batched_tokens=512, block_size=16)
    for i, prompt in enumerate(prompts[:streams]):
        engine.add_request(EngineRequest(f"online{i}", prompt, LONG, interactive=True))
    engine.step()  # the prompts, nothing decoding: the whole budget
    return engine


@pytest.mark.parametrize(
    ("repeats", "tokens"),
    [
        # 3 decodes run, 4 will once the waiting one joins (10 ms a step): 1.5 x 10 ms less the 3 decodes' 8 ms
        # leaves 7 ms, 63 prefill tokens.
        pytest.param(1, 63, id="bounded"),
        # The bound's 63 tokens would spread 400 over seven steps: a quarter of them a step (MAX_SPREAD).
        pytest.param(4, 100, id="spread-over-4-steps-at-most"),
    ],
)
def test_a_step_with_online_decodes_takes_a_bounded_prefill(
    make_engine: Callable[..., LLMEngine], random_prompts: Run, repeats: int, tokens: int
) -> None:
    prompts = random_prompts(4, 100, 100, seed=34)
    engine = _streaming(make_engine, prompts, streams=3)
    engine.add_request(EngineRequest("online3", prompts[3] * repeats, LONG, interactive=True))
    assert _given(engine, _measured()) == {"online0": 1, "online1": 1, "online2": 1, "online3": tokens}


def test_a_burst_of_online_prompts_beside_streams_is_not_bounded(
    make_engine: Callable[..., LLMEngine], random_prompts: Run
) -> None:
    prompts = random_prompts(6, 100, 100, seed=36)
    engine = _streaming(make_engine, prompts, streams=4)
    engine.add_request(EngineRequest("online4", prompts[4] * 6, LONG, interactive=True))
    engine.step()  # costs not measured yet: the whole budget, 508 of its 600 tokens
    engine.add_request(EngineRequest("online5", prompts[5], LONG, interactive=True))
    # Two prompts (one part computed) beside four streams: their first tokens come in one step, one stall rather than
    # a dozen.
    given = _given(engine, _measured())
    assert given == {"online0": 1, "online1": 1, "online2": 1, "online3": 1, "online4": 92, "online5": 100}


def test_batch_prompts_beside_streams_are_not_bounded_nor_served_before_online_ones(
    make_engine: Callable[..., LLMEngine], random_prompts: Run
) -> None:
    prompts = random_prompts(6, 100, 100, seed=37)
    engine = _streaming(make_engine, prompts, streams=3)
    engine.add_request(EngineRequest("batch0", prompts[3] * 12, LONG))
    engine.step()  # costs not measured yet: the whole budget, 509 of its 1,200 tokens
    engine.add_request(EngineRequest("online3", prompts[4], LONG, interactive=True))
    engine.add_request(EngineRequest("batch1", prompts[5], LONG))
    # A batch prompt computing: the step is the batch's, whole (509 tokens); the online prompt waiting is served
    # before the batch one running (which takes what it leaves), the batch line waiting gets nothing.
    given = _given(engine, _measured())
    assert given == {"online0": 1, "online1": 1, "online2": 1, "batch0": 409, "online3": 100}


def test_prefills_beside_batch_decodes_or_unmeasured_costs_are_not_bounded(
    make_engine: Callable[..., LLMEngine], random_prompts: Run
) -> None:
    prompts = random_prompts(3, 100, 100, seed=35)
    engine = make_engine(max_num_batched_tokens=512)
    engine.add_request(EngineRequest("batch0", prompts[0], LONG))
    engine.step()
    engine.add_request(EngineRequest("online", prompts[1], LONG, interactive=True))
    engine.add_request(EngineRequest("batch1", prompts[2], LONG))
    # Only a batch sequence decodes: an online prompt and a batch one take what the budget allows.
    assert _given(engine, _measured()) == {"batch0": 1, "online": 100, "batch1": 100}
    engine = make_engine(max_num_batched_tokens=512)
    engine.add_request(EngineRequest("online0", prompts[0], LONG, interactive=True))
    engine.step()
    engine.add_request(EngineRequest("online1", prompts[1], LONG, interactive=True))
    assert _given(engine, StepCosts(1.5, floor=16)) == {"online0": 1, "online1": 100}  # nothing measured yet


def test_step_costs_are_learned_from_step_times() -> None:
    costs = _measured()
    assert costs.decodes_s(3) == pytest.approx(0.008) and costs.decodes_s(1) == pytest.approx(0.004)
    assert costs.decodes_s(8) == pytest.approx(0.010)  # past the 4 measured: what 4 took (the weights' read)
    assert costs.prefill_token_s == pytest.approx(1.1e-4)
    assert costs.prefill_budget(2, expected=2) == 27  # 1.5 x 6 ms less 6 ms: 3 ms of prefill tokens
    assert costs.prefill_budget(2, expected=4) == 81  # two prompts waiting: the step they will make is the reference
    assert _measured(ratio=1.1).prefill_budget(2, expected=2) == 16  # 0.6 ms: 5 tokens, the floor
    costs.record(0.006 + 0.001, decodes=2, prefill=10)  # too few prefill tokens to tell their cost: not counted
    costs.record(0.006 + 0.033, decodes=2, prefill=100)  # 0.33 ms a token: the average moves part of the way
    assert costs.prefill_token_s == pytest.approx(1.1e-4 + SMOOTHING * 2.2e-4)
    one_size = StepCosts(1.5, floor=16)
    one_size.record(0.016, decodes=8, prefill=0)
    assert one_size.decodes_s(4) == pytest.approx(0.008)  # no line through one size: proportional
    assert one_size.prefill_budget(8, expected=8) is None  # no prefill token measured yet
    assert StepCosts(ratio=1.0, floor=16).prefill_budget(8, expected=8) is None
    assert "give 1" in (EngineConfig(max_mixed_step_ratio=0.5).usage_problem() or "")


def test_a_stalled_step_moves_the_costs_by_a_bounded_amount() -> None:
    costs = _measured()
    token_s = costs.prefill_token_s
    assert token_s is not None
    costs.record(1.0, decodes=2, prefill=0)  # a step stalled by a compilation or a collection: counted as 3x 6 ms
    stalled = _measured()
    stalled.record(0.018, decodes=2, prefill=0)
    assert costs.decodes_s(2) == pytest.approx(stalled.decodes_s(2))
    costs.record(0.006 + 10.0, decodes=2, prefill=100)  # 100 ms a prefill token: counted as 3x the average
    assert costs.prefill_token_s == pytest.approx(token_s + SMOOTHING * 2 * token_s)
    costs.forget()
    assert costs.decodes_s(2) == 0 and costs.prefill_token_s is None and costs.prefill_budget(2, expected=2) is None
    costs.record(1.0, decodes=2, prefill=0)  # the first step measured, a compilation's: nothing to clip it against
    costs.record(0.006, decodes=2, prefill=0)  # under a third of what the line says: it starts again from this one
    assert costs.decodes_s(2) == pytest.approx(0.006)
