"""Interactive (online) requests go ahead of batch work: admitted first, preempting a batch sequence for room."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchgen.server.engine import EngineRequest, LLMEngine, SamplingParams

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
