"""Prompt logprobs (what scoring asks for) against the model's own forward: whole prompts, chunked prefill, prefix
cache hits, several prompts and n choices in one step, and requests that ask for none beside them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from batchgen.server.engine import EngineRequest, EngineResult, LLMEngine, SamplingParams
from batchgen.server.engine.sampling import prompt_logprobs


def _reference(hf_model: Any, prompt: list[int]) -> torch.Tensor:
    """Log-softmax of the model's own logits at every prompt position."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def _check(result: EngineResult, prompt: list[int], hf_model: Any, top: int, ranks: bool = True) -> None:
    assert result.error is None and result.prompt_logprobs is not None
    assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] is None
    reference = _reference(hf_model, prompt)
    for position, lp in enumerate(result.prompt_logprobs[1:], start=1):
        assert lp is not None and lp.token_id == prompt[position]
        expected = reference[position - 1]
        assert lp.logprob == pytest.approx(float(expected[prompt[position]]), abs=1e-6)
        assert lp.rank == (int((expected > expected[prompt[position]]).sum()) + 1 if ranks else None)
        values, ids = expected.topk(top)
        assert [token for token, _ in lp.top] == ids.tolist()
        assert [value for _, value in lp.top] == pytest.approx(values.tolist(), abs=1e-6)


def _request(request_id: str, prompt: list[int], top: int | None, **params: Any) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=3, prompt_logprobs=top, **params))


@pytest.mark.parametrize(
    ("budget", "async_scheduling"), [(2048, "off"), (16, "off"), (16, "on")], ids=["whole", "chunked", "async"]
)
def test_prompt_logprobs_match_the_models_forward_with_others_in_the_batch(
    make_engine: Callable[..., LLMEngine],
    run_to_completion: Any,
    random_prompts: Any,
    hf_model: Any,
    hf_greedy: Any,
    budget: int,
    async_scheduling: str,
) -> None:
    engine = make_engine(max_num_batched_tokens=budget, block_size=8, async_scheduling=async_scheduling)
    prompts = random_prompts(4, 20, 45, seed=3)
    requests = [
        _request("a", prompts[0], 2),
        _request("plain", prompts[1], None),
        _request("b", prompts[2], 0, n=2, temperature=0.7, seed=1),
        _request("c", prompts[3], 5, logprobs=True, top_logprobs=1, prompt_ranks=False),
    ]
    results = run_to_completion(engine, requests)
    _check(results["a"], prompts[0], hf_model, 2)
    _check(results["b"], prompts[2], hf_model, 0)
    _check(results["c"], prompts[3], hf_model, 5, ranks=False)
    assert results["plain"].prompt_logprobs is None
    assert len(results["b"].outputs) == 2
    for request_id, prompt in (("a", prompts[0]), ("plain", prompts[1])):  # generation is untouched
        assert results[request_id].outputs[0].token_ids == hf_greedy(prompt, 3)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(
    make_engine: Callable[..., LLMEngine], run_to_completion: Any, random_prompts: Any, hf_model: Any
) -> None:
    engine = make_engine(block_size=8)
    prompt = random_prompts(1, 40, 40, seed=4)[0]
    first = run_to_completion(engine, [_request("warm", prompt, None)])["warm"]
    assert first.cached_tokens == 0
    plain = run_to_completion(engine, [_request("plain", prompt, None)])["plain"]
    assert plain.cached_tokens == 32  # the prefix is cached ...
    scored = run_to_completion(engine, [_request("scored", [*prompt, 7, 9], 1)])["scored"]
    assert scored.cached_tokens == 0  # ... and not read for a request that scores its prompt
    _check(scored, [*prompt, 7, 9], hf_model, 1)


def test_a_one_token_prompt_has_only_the_null_entry(
    make_engine: Callable[..., LLMEngine], run_to_completion: Any
) -> None:
    result = run_to_completion(make_engine(), [_request("one", [65], 3)])["one"]
    assert result.prompt_logprobs == [None]


def test_preempted_scoring_requests_score_the_same(
    make_engine: Callable[..., LLMEngine],
    run_to_completion: Any,
    random_prompts: Any,
    hf_model: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cache too small for all of them: sequences are preempted and recomputed; scored a few rows at a time."""
    monkeypatch.setattr(prompt_logprobs, "ROWS_AT_ONCE", 5)
    engine = make_engine(num_kv_blocks=14, block_size=8)
    prompts = random_prompts(3, 28, 34, seed=5)
    params = SamplingParams(max_tokens=20, prompt_logprobs=2, ignore_eos=True)
    requests = [EngineRequest(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
    results = run_to_completion(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        _check(results[f"r{i}"], prompt, hf_model, 2)
