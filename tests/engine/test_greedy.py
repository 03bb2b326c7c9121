"""Greedy outputs must equal Hugging Face ``generate()`` run one request at a time, token for token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from batchgen.server.engine import EngineRequest, LLMEngine, SamplingParams

MAX_NEW = 24


def _check_against_hf(results: dict[str, Any], prompts: list[list[int]], hf_greedy: Callable[..., list[int]]) -> None:
    for i, prompt in enumerate(prompts):
        result = results[f"r{i}"]
        assert result.error is None
        assert result.prompt_tokens == len(prompt)
        for output in result.outputs:
            assert output.token_ids == hf_greedy(prompt, MAX_NEW), f"prompt {i}, choice {output.index}"


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="default"),
        pytest.param({"max_num_batched_tokens": 40}, id="chunked-prefill"),
        pytest.param({"max_num_seqs": 5}, id="few-seqs"),
    ],
)
def test_concurrent_prompts_match_hf_generate(
    make_engine: Callable[..., LLMEngine],
    run_to_completion: Callable[..., Any],
    random_prompts: Callable[..., Any],
    hf_greedy: Callable[..., list[int]],
    overrides: dict[str, int],
) -> None:
    prompts = random_prompts(36, 1, 90)
    engine = make_engine(**overrides)
    requests = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=MAX_NEW)) for i, p in enumerate(prompts)]
    _check_against_hf(run_to_completion(engine, requests), prompts, hf_greedy)
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_tiny_block_budget_forces_preemption(
    make_engine: Callable[..., LLMEngine],
    run_to_completion: Callable[..., Any],
    random_prompts: Callable[..., Any],
    hf_greedy: Callable[..., list[int]],
) -> None:
    prompts = random_prompts(12, 20, 80, seed=1)
    engine = make_engine(num_kv_blocks=16, block_size=8, max_num_batched_tokens=64)
    requests = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=MAX_NEW)) for i, p in enumerate(prompts)]
    results = run_to_completion(engine, requests)
    assert engine.stats().preemptions > 0
    _check_against_hf(results, prompts, hf_greedy)


@pytest.mark.parametrize("block_size", [4, 16])
def test_shared_prefixes_hit_the_prefix_cache(
    make_engine: Callable[..., LLMEngine],
    run_to_completion: Callable[..., Any],
    random_prompts: Callable[..., Any],
    hf_greedy: Callable[..., list[int]],
    block_size: int,
) -> None:
    system = random_prompts(1, 50, 50, seed=2)[0]
    prompts = [system + suffix for suffix in random_prompts(32, 1, 30, seed=3)]
    engine = make_engine(block_size=block_size)
    first = run_to_completion(engine, [EngineRequest("r0", prompts[0], SamplingParams(max_tokens=MAX_NEW))])
    assert first["r0"].cached_tokens == 0
    rest = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=MAX_NEW)) for i, p in enumerate(prompts) if i]
    results = {**first, **run_to_completion(engine, rest)}
    _check_against_hf(results, prompts, hf_greedy)
    for i in range(1, len(prompts)):
        assert results[f"r{i}"].cached_tokens == len(system) // block_size * block_size
    assert engine.stats().cached_tokens > 0


def test_identical_prompt_is_served_from_cache_but_recomputes_its_last_token(
    make_engine: Callable[..., LLMEngine],
    run_to_completion: Callable[..., Any],
    random_prompts: Callable[..., Any],
    hf_greedy: Callable[..., list[int]],
) -> None:
    prompt = random_prompts(1, 32, 32, seed=4)[0]  # exactly two full blocks
    engine = make_engine(block_size=16)
    run_to_completion(engine, [EngineRequest("a", prompt, SamplingParams(max_tokens=MAX_NEW))])
    again = run_to_completion(engine, [EngineRequest("b", prompt, SamplingParams(max_tokens=MAX_NEW))])["b"]
    assert again.cached_tokens == 16
    assert again.outputs[0].token_ids == hf_greedy(prompt, MAX_NEW)


def test_prefix_caching_off_reports_no_cached_tokens(
    make_engine: Callable[..., LLMEngine], run_to_completion: Callable[..., Any], random_prompts: Callable[..., Any]
) -> None:
    prompt = random_prompts(1, 40, 40)[0]
    engine = make_engine(enable_prefix_caching=False)
    run_to_completion(engine, [EngineRequest("a", prompt, SamplingParams(max_tokens=4))])
    assert run_to_completion(engine, [EngineRequest("b", prompt, SamplingParams(max_tokens=4))])["b"].cached_tokens == 0


def test_n_choices_share_the_prompt_and_each_match_greedy(
    make_engine: Callable[..., LLMEngine],
    run_to_completion: Callable[..., Any],
    random_prompts: Callable[..., Any],
    hf_greedy: Callable[..., list[int]],
) -> None:
    prompts = random_prompts(6, 5, 40, seed=5)
    engine = make_engine(block_size=8)
    requests = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=MAX_NEW, n=3)) for i, p in enumerate(prompts)]
    results = run_to_completion(engine, requests)
    for i in range(len(prompts)):
        assert [o.index for o in results[f"r{i}"].outputs] == [0, 1, 2]
    _check_against_hf(results, prompts, hf_greedy)
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total
