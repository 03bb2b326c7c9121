"""Sampling, logprobs, penalties and every stop condition, checked against a direct forward of the model."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from batchgen.server.engine import EngineRequest, LLMEngine, SamplingParams
from batchgen.server.engine.sampling.batch_state import BatchState, SamplingInputs
from batchgen.server.engine.sampling.sampler import Sampler, argmax_first
from batchgen.server.engine.sampling.seeds import uniform, uniforms

Run = Callable[..., Any]


def _rows(vocab: int, specs: list[tuple[SamplingParams, int, int, list[int], list[int]]]) -> SamplingInputs:
    """One step's sampled rows, each ``(params, seed, position, prompt, generated)``, in a fresh batch state; stop
    token 1 (banned until ``min_tokens``)."""
    state = BatchState(vocab, torch.device("cpu"), capacity=4)
    rows = [
        state.add_row(params, seed, prompt, generated, frozenset({1})) for params, seed, _, prompt, generated in specs
    ]
    return state.inputs(rows, [position for _, _, position, _, _ in specs])


def _next_logits(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0, -1]


def _generate(engine: LLMEngine, run: Run, prompt: list[int], **params: Any) -> Any:
    return run(engine, [EngineRequest("x", prompt, SamplingParams(**params))])["x"]


def test_same_seed_reproduces_and_other_seeds_differ(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run
) -> None:
    prompts = random_prompts(8, 5, 30, seed=10)
    sampled = {"temperature": 1.0, "top_p": 0.95, "max_tokens": 16, "ignore_eos": True}

    def run(seed: int, crowd: int) -> list[list[int]]:
        engine = make_engine()
        requests = [EngineRequest(f"r{i}", p, SamplingParams(seed=seed, **sampled)) for i, p in enumerate(prompts)]
        # Other requests in the same steps must not change a seeded request's tokens.
        requests += [EngineRequest(f"crowd{i}", p, SamplingParams(**sampled)) for i, p in enumerate(prompts[:crowd])]
        results = run_to_completion(engine, requests)
        return [results[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]

    first = run(seed=7, crowd=0)
    assert run(seed=7, crowd=5) == first
    assert run(seed=8, crowd=0) != first


def test_top_k_one_equals_greedy(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run
) -> None:
    engine = make_engine()
    for prompt in random_prompts(4, 3, 30, seed=11):
        greedy = _generate(engine, run_to_completion, prompt, max_tokens=20)
        top1 = _generate(engine, run_to_completion, prompt, max_tokens=20, temperature=1.5, top_k=1, seed=3)
        assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 9e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, temperature: float
) -> None:
    """logits / 1e-40 overflow float32 and the distribution is NaN, which draws anything (found by tests/fuzz: a
    token the grammar forbade); below vLLM's 1e-5 a request decodes greedily."""
    engine = make_engine()
    prompt = [5, 6, 7, 8]
    greedy = _generate(engine, run_to_completion, prompt, max_tokens=12, ignore_eos=True)
    cold = _generate(engine, run_to_completion, prompt, max_tokens=12, ignore_eos=True, temperature=temperature, seed=1)
    assert cold.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_n_sampled_choices_are_independent(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run
) -> None:
    prompt = random_prompts(1, 20, 20, seed=12)[0]
    result = _generate(
        make_engine(), run_to_completion, prompt, n=4, temperature=1.0, max_tokens=12, seed=1, ignore_eos=True
    )
    choices = [tuple(o.token_ids) for o in result.outputs]
    assert [o.index for o in result.outputs] == [0, 1, 2, 3]
    assert all(len(c) == 12 for c in choices)
    assert len(set(choices)) > 1
    assert result.completion_tokens == 48


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 1.0), (0.7, 0.9), (-1.0, 0.0)])
def test_penalties_follow_the_openai_definition(
    make_engine: Callable[..., LLMEngine],
    run_to_completion: Run,
    random_prompts: Run,
    hf_model: Any,
    presence: float,
    frequency: float,
) -> None:
    prompt = random_prompts(1, 10, 10, seed=13)[0]
    params = {"max_tokens": 16, "ignore_eos": True, "presence_penalty": presence, "frequency_penalty": frequency}
    generated = _generate(make_engine(), run_to_completion, prompt, **params).outputs[0].token_ids
    assert len(generated) == 16
    for t, token in enumerate(generated):
        logits = _next_logits(hf_model, prompt + generated[:t])
        counts = torch.bincount(torch.tensor(generated[:t], dtype=torch.long), minlength=logits.shape[0]).double()
        penalised = logits - counts * frequency - (counts > 0).double() * presence
        assert token == int(penalised.argmax())
    plain = _generate(make_engine(), run_to_completion, prompt, max_tokens=16, ignore_eos=True).outputs[0].token_ids
    assert generated != plain


def test_logprobs_match_a_direct_forward(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run, hf_model: Any
) -> None:
    prompt = random_prompts(1, 15, 15, seed=14)[0]
    output = _generate(
        make_engine(), run_to_completion, prompt, max_tokens=10, temperature=0.8, seed=5, logprobs=True, top_logprobs=3
    ).outputs[0]
    assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids) == 10
    for t, (token, lp) in enumerate(zip(output.token_ids, output.logprobs, strict=True)):
        log_probs = torch.log_softmax(_next_logits(hf_model, prompt + output.token_ids[:t]), dim=-1)
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(log_probs[token]), abs=1e-6)
        top_values, top_ids = log_probs.topk(3)
        assert [i for i, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-6)


def test_stop_string_across_token_boundaries_is_trimmed(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run
) -> None:
    engine = make_engine()
    prompt = list(b"Once upon a time")
    full = _generate(engine, run_to_completion, prompt, max_tokens=30, ignore_eos=True).outputs[0]
    stop = full.text[6:9]  # three byte tokens in the middle of the output
    assert len(stop) == 3
    stopped = _generate(
        engine, run_to_completion, prompt, max_tokens=30, ignore_eos=True, stop=(stop, "\x00never")
    ).outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.find(stop)]
    assert stop not in stopped.text


def test_eos_stops_and_ignore_eos_does_not(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run, tokenizer: Any
) -> None:
    engine = make_engine()
    eos = tokenizer.eos_token_id
    prompts = random_prompts(32, 1, 60, seed=0)
    results = run_to_completion(
        engine, [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=20)) for i, p in enumerate(prompts)]
    )
    stopped = [r for r in results.values() if r.outputs[0].finish_reason == "stop"]
    assert stopped, "some greedy output of the demo model should reach EOS"
    for result in stopped:
        output = result.outputs[0]
        assert output.token_ids[-1] == eos and eos not in output.token_ids[:-1]
        assert output.text == tokenizer.decode(output.token_ids[:-1])
    index = int(next(iter(r.request_id for r in stopped))[1:])
    ignored = _generate(engine, run_to_completion, prompts[index], max_tokens=20, ignore_eos=True).outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 20


def test_max_tokens_and_context_caps_give_length(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run
) -> None:
    engine = make_engine(max_model_len=64)
    assert engine.max_context_length == 64
    prompt = random_prompts(1, 10, 10, seed=16)[0]
    short = _generate(engine, run_to_completion, prompt, max_tokens=5, ignore_eos=True)
    assert short.outputs[0].finish_reason == "length" and short.completion_tokens == 5
    capped = _generate(engine, run_to_completion, prompt, max_context_length=15, ignore_eos=True)
    assert capped.outputs[0].finish_reason == "length" and capped.completion_tokens == 5
    to_model_limit = _generate(engine, run_to_completion, prompt, ignore_eos=True)
    assert to_model_limit.completion_tokens == 54


def test_prompt_longer_than_the_context_is_an_error_not_a_crash(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run
) -> None:
    engine = make_engine(max_model_len=32)
    too_long, fits = random_prompts(1, 40, 40)[0], random_prompts(1, 5, 5)[0]
    results = run_to_completion(
        engine,
        [
            EngineRequest("long", too_long, SamplingParams(max_tokens=4)),
            EngineRequest("full", too_long[:32], SamplingParams(max_tokens=4)),
            EngineRequest("capped", fits, SamplingParams(max_tokens=4, max_context_length=5)),
            EngineRequest("ok", fits, SamplingParams(max_tokens=4)),
            EngineRequest("embed-long", too_long, task="embed"),
        ],
    )
    for request_id in ("long", "full", "capped", "embed-long"):
        error = results[request_id].error
        assert error is not None and error.code == "context_length_exceeded", request_id
        assert results[request_id].outputs == []
    assert results["ok"].error is None and results["ok"].completion_tokens > 0


def test_token_ids_outside_the_vocabulary_are_an_error_not_a_crash(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run
) -> None:
    """The engine checks every token id a request names against the model itself, whoever made the request (on a GPU
    an id past the embedding is a device-side assert that ends every request on the device)."""
    engine = make_engine()
    vocab, fits = engine.vocab_size, random_prompts(1, 5, 5)[0]
    results = run_to_completion(
        engine,
        [
            EngineRequest("past", [*fits, vocab], SamplingParams(max_tokens=4)),
            EngineRequest("negative", [-1, *fits], SamplingParams(max_tokens=4)),
            EngineRequest("stop", fits, SamplingParams(max_tokens=4, stop_token_ids=(vocab + 7,), min_tokens=2)),
            EngineRequest("bias", fits, SamplingParams(max_tokens=4, logit_bias={-3: 1.0})),
            EngineRequest("embed", [vocab], task="embed"),
            EngineRequest("ok", fits, SamplingParams(max_tokens=4, stop_token_ids=(vocab - 1,), logit_bias={0: 1.0})),
        ],
    )
    codes = {rid: result.error.code for rid, result in results.items() if result.error is not None}
    invalid = {"past": "invalid_prompt", "negative": "invalid_prompt", "embed": "invalid_prompt"}
    assert codes == {**invalid, "stop": "invalid_value", "bias": "invalid_value"}
    assert f"(0-{vocab - 1}): [{vocab}]" in results["past"].error.message  # type: ignore[union-attr]
    assert results["ok"].completion_tokens == 4


def test_abort_request(make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run) -> None:
    engine = make_engine()
    prompts = random_prompts(6, 5, 20, seed=17)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    engine.step()
    assert engine.abort_request("r0")
    assert not engine.abort_request("r0")
    assert all(engine.abort_request(request_id) for request_id in ("r3", "r4", "r5"))
    results = run_to_completion(engine, [])
    assert sorted(results) == ["r1", "r2"]
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"temperature": 1.0}, 6),
        ({"temperature": 0.6}, 6),
        ({"temperature": 1.3, "top_k": 3}, 3),
        ({"temperature": 1.0, "top_p": 0.8}, None),
    ],
)
def test_sampling_draws_the_filtered_distribution(params: dict[str, Any], allowed: int | None) -> None:
    """Counts over many (seed, position) draws against the probabilities the filters leave: a chi-square test.
    The draws are a fixed function of seed and position, so the test is deterministic."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0], dtype=torch.float64)
    draws = 24_000
    rows = _rows(
        len(logits),
        [(SamplingParams(**params), seed, position, [0], []) for seed in range(draws // 8) for position in range(8)],
    )
    token_ids, _ = Sampler()(logits.expand(len(rows), -1), rows)
    probs = torch.softmax(logits / params["temperature"], dim=0)
    if "top_k" in params:
        probs[params["top_k"] :] = 0
    if "top_p" in params:
        probs[(probs.cumsum(0) - probs) >= params["top_p"]] = 0
    probs /= probs.sum()
    counts = torch.bincount(torch.tensor(token_ids), minlength=len(logits)).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0, "no token the filters removed is ever drawn"
    assert allowed is None or int(kept.sum()) == allowed
    expected = probs[kept] * draws
    chi_square = float(((counts[kept] - expected) ** 2 / expected).sum())
    # 99.9th percentile of chi-square with (kept - 1) degrees of freedom, for up to 5: 10.83, 13.82, 16.27, 18.47, 20.52
    assert chi_square < [10.83, 13.82, 16.27, 18.47, 20.52][int(kept.sum()) - 2]


def test_device_noise_is_the_python_hash_bit_for_bit() -> None:
    """The sampler hashes (seed, position) on the device; it must be exactly ``uniform``, seeds above 2**63 too."""
    rng = random.Random(0)
    pairs = [(rng.getrandbits(64), rng.randrange(1 << 20)) for _ in range(2000)] + [(2**64 - 1, 0), (0, 0), (2**63, 7)]
    seeds = torch.tensor([s - 2**64 if s >= 2**63 else s for s, _ in pairs], dtype=torch.long)
    positions = torch.tensor([p for _, p in pairs], dtype=torch.long)
    assert uniforms(seeds, positions).tolist() == [uniform(s, p) for s, p in pairs]


def test_a_row_samples_the_same_token_whatever_shares_its_batch() -> None:
    """Every row's token depends on its own logits, parameters, seed and position only."""
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(64, vocab, dtype=torch.float64) * 3
    kinds = [
        {"temperature": 0.0},
        {"temperature": 0.9, "top_k": 5},
        {"temperature": 1.2, "top_p": 0.7},
        {"temperature": 1.0, "min_p": 0.2},
        {"temperature": 1.0, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
        {"temperature": 0.7, "logit_bias": {3: 4.0}, "presence_penalty": -0.5},
        {"temperature": 1.0, "min_tokens": 8},
    ]
    specs = [(SamplingParams(**kinds[i % len(kinds)]), 1000 + i, 20 + i % 5, [i % vocab, 7], [7, 3]) for i in range(64)]
    together, _ = Sampler()(logits, _rows(vocab, specs))
    alone = [Sampler()(logits[i : i + 1], _rows(vocab, [spec]))[0][0] for i, spec in enumerate(specs)]
    reversed_batch, _ = Sampler()(logits.flip(0), _rows(vocab, specs[::-1]))
    assert together == alone == reversed_batch[::-1]


def test_a_row_that_filters_nothing_never_sorts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sorting the vocabulary is for min_p, top-k and top-p: a row with temperature alone (top-k at the vocabulary,
    top-p 1 included) draws from its distribution as it stands; beside a top-p row, only that row is sorted."""
    sorted_rows: list[int] = []
    sort = torch.Tensor.sort

    def spy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sorted_rows.append(self.shape[0])
        return sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", spy)
    vocab = 50
    logits = torch.randn(4, vocab, dtype=torch.float64)
    kinds = [{"temperature": 0.5}, {"temperature": 1.0, "top_k": vocab}, {"temperature": 1.7, "top_p": 1.0}]
    plain = [(SamplingParams(**kind), 1 + i, 3, [0], []) for i, kind in enumerate(kinds)]
    Sampler()(logits[:3], _rows(vocab, plain))
    assert sorted_rows == []
    Sampler()(logits, _rows(vocab, [*plain, (SamplingParams(temperature=1.0, top_p=0.9), 9, 3, [0], [])]))
    assert sorted_rows == [1]


def test_min_p_draws_only_tokens_near_the_likeliest() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0], dtype=torch.float64)
    rows = _rows(len(logits), [(SamplingParams(temperature=1.0, min_p=0.3), seed, 0, [0], []) for seed in range(4000)])
    token_ids, _ = Sampler()(logits.expand(len(rows), -1), rows)
    probs = torch.softmax(logits, dim=0)
    allowed = set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist())
    assert allowed == {0, 1, 2}
    assert set(token_ids) == allowed


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_follows_vllm(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run, hf_model: Any, penalty: float
) -> None:
    prompt = random_prompts(1, 12, 12, seed=21)[0]
    params = {"max_tokens": 12, "ignore_eos": True, "repetition_penalty": penalty}
    generated = _generate(make_engine(), run_to_completion, prompt, **params).outputs[0].token_ids
    for t, token in enumerate(generated):
        logits = _next_logits(hf_model, prompt + generated[:t])
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[prompt + generated[:t]] = True
        penalised = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        assert token == int(penalised.argmax())
    plain = _generate(make_engine(), run_to_completion, prompt, max_tokens=12, ignore_eos=True).outputs[0].token_ids
    assert generated != plain


def test_min_p_one_keeps_only_the_most_likely_token(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run
) -> None:
    engine = make_engine()
    for prompt in random_prompts(3, 3, 30, seed=19):
        greedy = _generate(engine, run_to_completion, prompt, max_tokens=20, ignore_eos=True)
        sampled = _generate(engine, run_to_completion, prompt, max_tokens=20, ignore_eos=True, temperature=2.0, seed=4)
        min_p = _generate(
            engine, run_to_completion, prompt, max_tokens=20, ignore_eos=True, temperature=2.0, seed=4, min_p=1.0
        )
        assert min_p.outputs[0].token_ids == greedy.outputs[0].token_ids != sampled.outputs[0].token_ids


def test_min_tokens_holds_back_eos_and_stop_strings(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run, hf_model: Any, tokenizer: Any
) -> None:
    engine = make_engine()
    eos = tokenizer.eos_token_id
    prompts = random_prompts(32, 1, 60, seed=0)
    prompt = next(  # one whose greedy output ends early at EOS
        p
        for p in prompts
        if (r := _generate(engine, run_to_completion, p, max_tokens=20)).outputs[0].finish_reason == "stop"
        and len(r.outputs[0].token_ids) < 12
    )
    held = _generate(engine, run_to_completion, prompt, max_tokens=30, min_tokens=15).outputs[0]
    assert len(held.token_ids) >= 15 and eos not in held.token_ids[:14]
    for t in range(15):  # the model's choice with EOS taken out, until min_tokens
        logits = _next_logits(hf_model, prompt + held.token_ids[:t])
        logits[eos] = float("-inf")
        assert held.token_ids[t] == int(logits.argmax())
    full = _generate(engine, run_to_completion, prompt, max_tokens=20, ignore_eos=True).outputs[0]
    stop = full.text[1:3]
    early = _generate(engine, run_to_completion, prompt, max_tokens=20, ignore_eos=True, stop=(stop,)).outputs[0]
    late = _generate(engine, run_to_completion, prompt, max_tokens=20, ignore_eos=True, stop=(stop,), min_tokens=8)
    assert early.text == full.text[:1] and len(early.token_ids) < 8
    assert full.text.startswith(late.outputs[0].text) and len(late.outputs[0].token_ids) >= 8


def test_logit_bias_forces_and_bans_tokens(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, random_prompts: Run, hf_model: Any
) -> None:
    engine = make_engine()
    prompt = random_prompts(1, 8, 8, seed=21)[0]
    forced = _generate(engine, run_to_completion, prompt, max_tokens=6, ignore_eos=True, logit_bias={ord("z"): 100.0})
    assert forced.outputs[0].text == "zzzzzz"
    first = int(_next_logits(hf_model, prompt).argmax())
    banned = _generate(engine, run_to_completion, prompt, max_tokens=1, ignore_eos=True, logit_bias={first: -100.0})
    logits = _next_logits(hf_model, prompt)
    logits[first] -= 100
    assert banned.outputs[0].token_ids == [int(logits.argmax())] != [first]


def test_special_tokens_in_the_text_only_when_asked(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, tokenizer: Any
) -> None:
    engine = make_engine()
    pad = {tokenizer.pad_token_id: 100.0}
    params = {"max_tokens": 3, "ignore_eos": True, "logit_bias": pad}
    assert _generate(engine, run_to_completion, list(b"Hi"), **params).outputs[0].text == ""
    kept = _generate(engine, run_to_completion, list(b"Hi"), skip_special_tokens=False, **params).outputs[0]
    assert kept.text == tokenizer.pad_token * 3
    with_stop = _generate(engine, run_to_completion, list(b"Hi"), skip_special_tokens=False, stop=("x",), **params)
    assert with_stop.outputs[0].text == tokenizer.pad_token * 3


def test_a_stop_token_is_not_part_of_the_text(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, tokenizer: Any
) -> None:
    engine = make_engine()
    full = _generate(engine, run_to_completion, list(b"Once upon"), max_tokens=12, ignore_eos=True).outputs[0]
    stop_id = full.token_ids[4]
    cut = full.token_ids.index(stop_id)
    stopped = _generate(
        engine, run_to_completion, list(b"Once upon"), max_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,)
    ).outputs[0]
    assert (stopped.finish_reason, stopped.token_ids) == ("stop", full.token_ids[: cut + 1])
    assert stopped.text == tokenizer.decode(full.token_ids[:cut])


def test_chunked_argmax_is_argmax() -> None:
    """The greedy choice is torch's: the first maximum of the row, ties and all (vocabularies of any width)."""
    torch.manual_seed(0)
    for vocab in (256, 32000, 1000):
        logits = torch.randn(9, vocab).round(decimals=1)  # many ties
        logits[3, :] = 0.0
        logits[4, [7, vocab - 1]] = 50.0
        assert torch.equal(argmax_first(logits), logits.argmax(dim=-1))
