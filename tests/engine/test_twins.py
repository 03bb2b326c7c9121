"""Lines that share a prompt prefix, submitted together, compute it once: a line whose first block still to compute
is being computed by another waits for it (``engine/core/twins.py``), and the lines behind it run meanwhile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from batchgen.server.engine import EngineRequest, LLMEngine, SamplingParams

MAX_NEW = 4


def _computed(engine: LLMEngine) -> int:
    stats = engine.stats()
    return stats.prompt_tokens - stats.cached_tokens


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_identical_prompts_submitted_together_compute_the_prompt_once(
    async_scheduling: str,
    make_engine: Callable[..., LLMEngine],
    run_to_completion: Callable[..., Any],
    random_prompts: Callable[..., Any],
    hf_greedy: Callable[..., list[int]],
) -> None:
    """8 lines of one 200-token prompt (n samples as separate lines): the first computes it, the other 7 resume at
    its last block boundary (192) and compute the 8 tokens after it: 256 tokens, not 1,600. With async scheduling
    too (the blocks are published a step later)."""
    prompt = random_prompts(1, 200, 200, seed=7)[0]
    engine = make_engine(block_size=16, async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=MAX_NEW)
    results = run_to_completion(engine, [EngineRequest(f"r{i}", prompt, params) for i in range(8)])
    assert [results[f"r{i}"].cached_tokens for i in range(8)] == [0] + [192] * 7
    assert _computed(engine) == 200 + 7 * 8
    expected = hf_greedy(prompt, MAX_NEW)
    assert all(results[f"r{i}"].outputs[0].token_ids == expected for i in range(8))


def test_lines_under_one_system_prompt_wait_for_it_and_the_others_run_meanwhile(
    make_engine: Callable[..., LLMEngine],
    run_to_completion: Callable[..., Any],
    random_prompts: Callable[..., Any],
    hf_greedy: Callable[..., list[int]],
) -> None:
    """Lines under one 50-token system prompt (3 blocks of 16) submitted with an unrelated line and an online twin:
    in the first step the online line (first everywhere, never held back) and the unrelated one run while every batch
    line under the system prompt waits for the online one's blocks; then each starts from the 48 cached tokens (r0,
    the online line's prompt again, from more). Exact tokens throughout."""
    system = random_prompts(1, 50, 50, seed=8)[0]
    prompts = [system + suffix for suffix in random_prompts(5, 1, 20, seed=9)]
    other = random_prompts(1, 30, 30, seed=10)[0]
    engine = make_engine(block_size=16)
    params = SamplingParams(max_tokens=MAX_NEW)
    requests = [EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    requests.insert(2, EngineRequest("other", other, params))
    requests.append(EngineRequest("online", prompts[0], params, interactive=True))
    for request in requests:
        engine.add_request(request)
    engine.step()
    running = {seq.state.request.request_id for seq in engine.scheduler.running}
    assert running == {"online", "other"}, running
    assert [seq.state.request.request_id for seq in engine.scheduler.waiting] == [f"r{i}" for i in range(5)]
    results = run_to_completion(engine, [])
    repeat = (len(prompts[0]) - 1) // 16 * 16  # r0 repeats the online line's prompt: all but its last block
    assert [results[f"r{i}"].cached_tokens for i in range(5)] == [repeat] + [48] * 4
    assert results["online"].cached_tokens == 0
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"].outputs[0].token_ids == hf_greedy(prompt, MAX_NEW)
    assert results["online"].outputs[0].token_ids == hf_greedy(prompts[0], MAX_NEW)
    assert results["other"].outputs[0].token_ids == hf_greedy(other, MAX_NEW)
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total
    assert not engine.scheduler.block_manager.claims.owner  # every claim given up
