"""Hybrid and state-space models (linear attention, Mamba 1 and 2, short convolutions beside attention, or alone)
against Hugging Face greedy decoding, as ``test_architectures.py`` checks attention-only ones: tiny random models of
each family built from transformers' own config classes, the same tokens as ``generate(do_sample=False)`` and
logprobs within 1e-4, with chunked prefill continuing at any offset, ``n`` > 1 forks (a copy of the state), prefix hits
(from a checkpoint of the state), and preemption (the state freed and recomputed).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_architectures import NEW_TOKENS, Reference, _build, _check, _engine, _prompts, _run

from batchgen.server.engine import EngineRequest, SamplingParams
from batchgen.server.engine.config import EngineConfig
from batchgen.server.engine.features.state.mixers import StateRun
from batchgen.server.engine.features.state.slots import StateSlots
from batchgen.server.engine.loading.demo_model import build_tokenizer
from batchgen.server.engine.ops.fast_paths import FastPath
from batchgen.server.engine.runner.capacity import cache_sizes
from batchgen.server.engine.runner.model_runner import ModelRunner

GDN = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "head_dim": 16,
}
MAMBA2 = {
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
}
GDN_KERNELS = {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}
"""The families whose Gated DeltaNet layers run the engine's CPU kernels (``state/gdn.py``), not the layer's forward."""
LINEAR_FULL = {"num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2}
EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

FAMILIES: dict[str, dict[str, Any]] = {
    # What AutoModelForCausalLM builds of a Qwen3.5 checkpoint (model_type qwen3_5: the text model of its config).
    "qwen3_5_text": {**GDN, **LINEAR_FULL},
    "qwen3_5_moe_text": {**GDN, **LINEAR_FULL, **EXPERTS, "shared_expert_intermediate_size": 32},
    "qwen3_next": {**GDN, **LINEAR_FULL, **EXPERTS, "shared_expert_intermediate_size": 32},
    "olmo_hybrid": {**GDN, **LINEAR_FULL, "pad_token_id": 0},
    "kimi_linear": {
        **LINEAR_FULL,
        "moe_intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "linear_head_dim": 16,
        "linear_num_heads": 4,
        "num_key_value_heads": 4,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "pad_token_id": 0,
    },
    "granitemoehybrid": {
        **MAMBA2,
        "num_hidden_layers": 4,
        "shared_intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["mamba", "attention"] * 2,
    },
    "bamba": {**MAMBA2, "num_hidden_layers": 4, "attn_layer_indices": [1, 3]},
    "falcon_h1": {**MAMBA2, "mamba_d_ssm": 128, "head_dim": 16},  # mamba and attention side by side in each layer
    "nemotron_h": {
        "num_hidden_layers": 4,
        "head_dim": 16,
        "ssm_state_size": 16,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "chunk_size": 16,
        "layers_block_type": ["mamba", "attention", "mlp", "mamba"],
    },
    "jamba": {  # its selective scan takes no initial state: continued chunks run token by token
        "num_hidden_layers": 4,
        "num_experts": 2,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "use_mamba_kernels": False,
    },
    "mamba2": {  # no attention at all
        "num_heads": 8,
        "head_dim": 16,
        "state_size": 16,
        "n_groups": 2,
        "expand": 2,
        "conv_kernel": 4,
        "chunk_size": 16,
    },
    "mamba": {"state_size": 8, "expand": 2, "conv_kernel": 4, "use_mambapy": False},
    "lfm2": {"num_hidden_layers": 4, "conv_L_cache": 3, "full_attn_idxs": [1, 3]},
    "lfm2_moe": {
        **EXPERTS,
        "num_hidden_layers": 4,
        "num_dense_layers": 1,
        "conv_L_cache": 3,
        "layer_types": ["conv", "full_attention"] * 2,
    },
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(
    request: pytest.FixtureRequest, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, Reference]]:
    path = _build(request.param, FAMILIES[request.param], tokenizer, tmp_path_factory.mktemp(request.param))
    yield path, Reference(path)


def test_exact_with_chunks_forks_and_prefix_hits(
    family: tuple[Path, Reference], tokenizer: Any, request: pytest.FixtureRequest
) -> None:
    """Chunks of 16 on blocks of 8 (prompts continued at any offset), n = 2, and a second wave whose prompts extend a
    first-wave prompt: found from the state's checkpoint at that prompt's last block boundary."""
    path, reference = family
    engine = _engine(path, tokenizer, block_size=8, max_num_batched_tokens=16)
    paths = dict(path.state() for path in engine.runner.paths)
    assert ("Gated DeltaNet kernels" in paths) == (request.node.callspec.params["family"] in GDN_KERNELS), paths
    assert paths.get("Gated DeltaNet kernels") is None  # on where it applies
    _check(engine, reference, n=2)
    stats = engine.stats()
    assert stats.state_bytes_per_seq > 0 and stats.state_checkpoints > 0
    assert stats.state_slots * stats.state_bytes_per_seq == stats.state_cache_bytes


@pytest.fixture(scope="module")
def qwen3_5(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Reference]:
    path = _build("qwen3_5_text", FAMILIES["qwen3_5_text"], tokenizer, tmp_path_factory.mktemp("qwen3_5-preempted"))
    return path, Reference(path)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_recomputes_the_state(qwen3_5: tuple[Path, Reference], tokenizer: Any, prefix_caching: bool) -> None:
    """Too few KV blocks for every prompt at once: sequences are preempted, their state slot freed, and recomputed
    (from the start, or from a checkpoint of their prompt) to the same tokens."""
    path, reference = qwen3_5
    engine = _engine(
        path, tokenizer, block_size=8, max_num_batched_tokens=32, num_kv_blocks=14, enable_prefix_caching=prefix_caching
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
    prompts = _prompts()[:4]
    requests = [EngineRequest(f"p{i}", list(p), params) for i, p in enumerate(prompts)]
    results = _run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for request, prompt in zip(requests, prompts, strict=True):
        tokens, logprobs = reference.greedy(prompt)
        (output,) = results[request.request_id].outputs
        assert output.token_ids == tokens
        assert output.logprobs is not None
        assert max(abs(lp.logprob - logprobs[i, lp.token_id].item()) for i, lp in enumerate(output.logprobs)) < 1e-4
    assert engine.runner.states is not None
    slots = engine.runner.states.slots
    assert slots.can_take() and len(slots._free_live) == slots.live  # every live slot back


def test_a_shared_system_prompt_is_computed_once(qwen3_5: tuple[Path, Reference], tokenizer: Any) -> None:
    """Lines under one 27-token system prompt, two at a time: the second line waits for the first's blocks (a twin:
    ``engine/core/twins.py``), which leaves a checkpoint of the state where their shared prefix ends (24 tokens, 3
    blocks of 8: far below vLLM's 528-token blocks), and it and every later line start from there."""
    path, reference = qwen3_5
    engine = _engine(path, tokenizer, block_size=8, max_num_seqs=2)
    system = list(_prompts()[4][:27])
    prompts = [tuple(system + list(p[:n])) for p, n in zip(_prompts()[:4] * 2, (3, 5, 9, 2, 7, 4, 6, 8), strict=True)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    results = _run(engine, [EngineRequest(f"p{i}", list(p), params) for i, p in enumerate(prompts)])
    cached = [results[f"p{i}"].cached_tokens for i in range(len(prompts))]
    assert cached[0] == 0 and all(c >= 24 for c in cached[1:]), cached  # 32: a longer shared prefix
    for i, prompt in enumerate(prompts):
        assert results[f"p{i}"].outputs[0].token_ids == reference.greedy(prompt)[0][:4]


def test_an_exact_repeat_of_a_whole_blocks_prompt_hits(qwen3_5: tuple[Path, Reference], tokenizer: Any) -> None:
    """The same 40-token prompt (5 blocks of 8) as four lines, two at a time (n samples as separate lines): the
    second waits for the first's blocks rather than compute them beside it, and a repeat must recompute at least the
    last token, so each resumes at the last block boundary before the prompt's end (32), where the first line left
    a checkpoint beside the one at its end (40, for longer prompts extending it)."""
    path, reference = qwen3_5
    engine = _engine(path, tokenizer, block_size=8, max_num_seqs=2)
    prompt = _prompts()[4]
    assert len(prompt) == 40
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    results = _run(engine, [EngineRequest(f"p{i}", list(prompt), params) for i in range(4)])
    assert [results[f"p{i}"].cached_tokens for i in range(4)] == [0, 32, 32, 32]
    stats = engine.stats()
    assert stats.prompt_tokens - stats.cached_tokens == 40 + 8 + 8 + 8
    for i in range(4):
        assert results[f"p{i}"].outputs[0].token_ids == reference.greedy(prompt)[0][:4]


def test_a_repeat_waits_for_a_chunked_prompt_and_resumes_where_it_leaves_a_checkpoint(
    qwen3_5: tuple[Path, Reference], tokenizer: Any
) -> None:
    """An unrelated 10-token line, then three lines of the 40-token prompt, 24 tokens a step: the first line's first
    chunk (14 tokens) publishes a block with no checkpoint of the state, so the repeats keep waiting while it computes
    the rest (a hit cannot start there), and it leaves a checkpoint where they resume (32): each computes 8 tokens."""
    path, reference = qwen3_5
    engine = _engine(path, tokenizer, block_size=8, max_num_batched_tokens=24)
    prompt, other = _prompts()[4], _prompts()[0][:10]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    requests = [EngineRequest("other", list(other), params)]
    requests += [EngineRequest(f"p{i}", list(prompt), params) for i in range(3)]
    results = _run(engine, requests)
    assert [results[f"p{i}"].cached_tokens for i in range(3)] == [0, 32, 32]
    for i in range(3):
        assert results[f"p{i}"].outputs[0].token_ids == reference.greedy(prompt)[0][:4]
    assert results["other"].outputs[0].token_ids == reference.greedy(other)[0][:4]


def test_a_failing_step_recomputes_the_states_it_advanced(
    qwen3_5: tuple[Path, Reference], tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step fails after its forward ran (every state slot in it advanced): the engine retries it in halves to pin
    the fault on its request, each sequence from its first token, so the others' tokens are exactly what they would
    have been."""
    path, reference = qwen3_5
    engine = _engine(path, tokenizer, block_size=8, max_num_batched_tokens=16)
    execute = ModelRunner.execute

    def faulty(self: ModelRunner, scheduled: list[Any], *args: Any) -> Any:
        launched = execute(self, scheduled, *args)
        if any(item.seq.state.request.request_id == "bad" for item in scheduled):
            raise RuntimeError("injected after the forward")
        return launched

    monkeypatch.setattr(ModelRunner, "execute", faulty)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _prompts()[:4]
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"p{i}", list(prompt), params))
    results = {r.request_id: r for r in engine.step() + engine.step()}  # mid-prompt and decoding
    results |= _run(engine, [EngineRequest("bad", [5, 6, 7, 8, 9], params)])
    error = results["bad"].error
    assert error is not None and "injected after the forward" in error.message
    for i, prompt in enumerate(prompts):
        assert results[f"p{i}"].outputs[0].token_ids == reference.greedy(prompt)[0]


def test_a_fast_path_failing_midway_computes_the_step_again_from_scratch(
    qwen3_5: tuple[Path, Reference], tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled forward fails in a decode step after the first state layer advanced its states in place: the
    compiled path is switched off and the step computed again from the sequences' first tokens (an eager retry of the
    step alone ran from the states the failed attempt had advanced: other tokens). The compiled forward is stood in
    for by the eager one under a fast path's rule, failing once."""
    path, reference = qwen3_5
    engine = _engine(path, tokenizer)
    compiled = FastPath("compiled layers")
    engine.runner.fast = SimpleNamespace(paths=[compiled], off=nullcontext)  # type: ignore[assignment]
    failed: list[bool] = []
    run = StateRun.run

    def failing_once(self: StateRun, hidden: Any) -> Any:
        if self.layers_run == 1 and self.step.decode_rows and not failed:  # the second layer of a decode step
            failed.append(True)
            raise RuntimeError("injected: the compiled forward failed")
        return run(self, hidden)

    monkeypatch.setattr(StateRun, "run", failing_once)
    _check(engine, reference)
    assert failed and compiled.off == "RuntimeError: injected: the compiled forward failed"


def test_a_step_the_plain_path_fails_too_is_the_inputs_fault_and_the_fast_path_stays(
    qwen3_5: tuple[Path, Reference], tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step fails on the compiled forward, and again as it is computed from scratch on the plain one: the
    request is failed alone (its inputs' fault) and the compiled path stays on for the next request, which is exact."""
    path, reference = qwen3_5
    engine = _engine(path, tokenizer)
    compiled = FastPath("compiled layers")
    engine.runner.fast = SimpleNamespace(paths=[compiled], off=nullcontext)  # type: ignore[assignment]
    failures: list[bool] = []
    run = StateRun.run

    def failing_twice(self: StateRun, hidden: Any) -> Any:
        # The compiled decode step, then its recomputation from scratch (a prefill).
        if (self.step.decode_rows or failures) and len(failures) < 2:
            failures.append(True)
            raise RuntimeError("injected: this step's inputs fail")
        return run(self, hidden)

    monkeypatch.setattr(StateRun, "run", failing_twice)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = list(_prompts()[1])
    failed = _run(engine, [EngineRequest("failed", prompt, params)])["failed"]
    assert failures == [True, True] and failed.error is not None
    assert compiled.on
    result = _run(engine, [EngineRequest("next", prompt, params)])["next"]
    assert result.error is None and result.outputs[0].token_ids == reference.greedy(tuple(prompt))[0][:4]


def test_live_slots_bound_the_running_sequences(qwen3_5: tuple[Path, Reference], tokenizer: Any) -> None:
    """The state slots come out of the cache's memory budget: the KV blocks keep room for one full context, the live
    slots take the rest (up to ``--max-num-seqs``), so no more sequences than that run at once, and every request
    still completes exactly."""
    path, reference = qwen3_5
    probe = _engine(path, tokenizer)
    slot, block = probe.stats().state_bytes_per_seq, probe.runner.block_bytes
    budget = 4 * block + 3.5 * slot  # a context of 64 tokens, and 3 slots
    engine = _engine(
        path,
        tokenizer,
        num_kv_blocks=None,
        cpu_kv_cache_gib=budget / 2**30,
        max_model_len=64,
        state_checkpoint_fraction=0,
    )
    live = engine.runner.max_num_seqs
    assert live == 3 and engine.scheduler.max_num_seqs == live
    assert engine.runner.num_blocks >= 4
    stats = engine.stats()
    assert stats.kv_cache_bytes + stats.state_cache_bytes <= budget
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [p[:24] for p in _prompts()[1:]]
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"p{i}", list(prompt), params))
    results: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        results.update((r.request_id, r) for r in engine.step())
        assert len(engine.scheduler.running) <= live
    for i, prompt in enumerate(prompts):
        assert results[f"p{i}"].outputs[0].token_ids == reference.greedy(prompt)[0]


def test_cache_sizes_share_one_budget() -> None:
    config = EngineConfig(model="m", max_num_seqs=8, block_size=16, state_checkpoint_fraction=0.25)
    budget = 1000.0 * 1024
    sizes = cache_sizes(budget, 1024, 100, config, 256)
    assert sizes.checkpoint_slots == 2560  # a quarter of the budget
    assert sizes.live_slots == 8
    assert sizes.blocks == (1000 * 1024 - (2560 + 8) * 100) // 1024
    # A dear slot: the blocks keep room for one full context, the live slots get what is left.
    dear = cache_sizes(budget, 1024, 100 * 1024, config, 256)
    assert (dear.checkpoint_slots, dear.live_slots) == (2, 7)
    assert dear.blocks * 16 >= 256 and (2 + 7) * 100 * 1024 + dear.blocks * 1024 <= budget
    # No attention (Mamba 2): zero-byte blocks, enough to name every running sequence's context.
    assert cache_sizes(1000.0 * 1024, 0, 100 * 1024, config, 256).blocks == 8 * 16
    with pytest.raises(RuntimeError, match="one sequence's state"):
        cache_sizes(1000.0, 1024, 100 * 1024, config, 256)


def test_checkpoints_are_kept_least_recently_used_and_dropped_with_their_block() -> None:
    copies: list[tuple[int, int]] = []
    slots = StateSlots(live=2, checkpoints=2, copy=lambda src, dst: copies.append((src, dst)))
    first, second = slots.take(101), slots.take(102)
    assert first is not None and second is not None
    slots.publish(101, first)
    slots.publish(102, second)
    assert slots.longest([101, 102]) == (2, second)
    assert slots.longest([101, 999]) == (1, first)  # 101 is now the most recently used
    third = slots.take(103)  # none free: 102, least recently used, is evicted
    assert third == second and slots.longest([101, 102]) == (1, first)
    slots.discard(third)
    slots.forget(101)  # its block was recycled
    assert slots.longest([101]) == (0, None) and slots.published == 0


def test_a_checkpoint_kept_or_being_written_is_not_taken_twice() -> None:
    """Lines repeating a prompt cross the same boundaries: only the first takes a slot there, so repeats never evict
    other prefixes' checkpoints for a copy they would drop."""
    slots = StateSlots(live=2, checkpoints=2, copy=lambda src, dst: None)
    writing = slots.take(101)
    assert writing is not None and slots.take(101) is None  # being written
    other = slots.take(102)
    assert other is not None
    slots.publish(102, other)
    slots.publish(101, writing)
    assert slots.take(101) is None and slots.take(102) is None  # kept: no slot evicted for a copy
    assert slots.published == 2
    assert slots.take(103) == writing  # 101, least recently used (102 was touched after it), is evicted
    slots.discard(writing)
    assert slots.take(101) is not None  # no longer kept nor written: taken again
