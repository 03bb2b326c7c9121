"""``--tensor-parallel-size 2`` on CPU (gloo): a tiny Llama split over two ranks, one process each, gives
transformers' greedy tokens, and its logprobs within 1e-4, through plain and chunked prefill and prefix-cache hits;
each rank holds half the KV heads and half of every split weight. A model that cannot be split is refused in one line
naming the sizes that work, before any rank starts; a rank that cannot start is one line naming it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_architectures import ARCHITECTURES, Reference, _build, _check

from batchgen.server.engine import EngineConfig, LLMEngine, build_engine
from batchgen.server.engine.demo_model import build_tokenizer
from batchgen.server.engine.errors import ModelLoadError, ModelNotSupported

FAULTS = Path(__file__).resolve().parents[1] / "faults"

DEEPSEEK_V3 = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "num_key_value_heads": 4,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}
"""MLA (a compressed KV projection, split by the ``mla_kv_a_proj`` rule), a dense first layer, then routed experts."""
SPLIT_ARCHITECTURES = {
    "qwen3_moe": ARCHITECTURES["qwen3_moe"],
    "gemma3_text": ARCHITECTURES["gemma3_text"],
    "gpt_oss": ARCHITECTURES["gpt_oss"],
    "deepseek_v3": DEEPSEEK_V3,
}
EXPERT_PARALLEL = {"qwen3_moe": False, "gemma3_text": False, "gpt_oss": True, "deepseek_v3": True}
"""Qwen3-MoE's experts split by their inner width; Gemma 3's windows and soft-caps; gpt-oss's sinks split with their
heads and its experts spread over the ranks (``--enable-expert-parallel``), as DeepSeek-V3's beside MLA."""


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build("llama", {}, build_tokenizer(), tmp_path_factory.mktemp("llama"))


def _config(path: Path, **overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "num_kv_blocks": 128,
        "max_num_batched_tokens": 24,  # the longer prompts are prefilled in chunks
        "tensor_parallel_size": 2,
        "torch_threads": 1,
        "distributed_timeout_s": 20,
    }
    return EngineConfig(model=str(path), dtype="float32", device="cpu", **{**settings, **overrides})


@pytest.fixture(scope="module")
def split(llama: Path) -> Iterator[LLMEngine]:
    """One group of two ranks for the module (its self-check runs at start)."""
    engine = build_engine(_config(llama))
    assert isinstance(engine, LLMEngine)
    yield engine
    assert engine.runner.group is not None
    engine.runner.group.stop()


def test_two_ranks_give_transformers_tokens_and_logprobs(split: LLMEngine, llama: Path) -> None:
    _check(split, Reference(llama))


def test_each_rank_holds_its_share(split: LLMEngine, llama: Path) -> None:
    runner = split.runner
    assert [cache.shape[0] for cache in runner.cache.k] == [1, 1]  # 2 KV heads, one each
    q_proj = runner.model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.to_local().shape == (32, 64)  # 64 rows of query heads, half each
    assert runner.group is not None and not runner.group.broken


def test_a_model_that_cannot_be_split_is_refused_in_one_line(llama: Path) -> None:
    with pytest.raises(ModelNotSupported) as refused:
        build_engine(_config(llama, tensor_parallel_size=3))
    message = str(refused.value)
    assert "4 attention heads and 2 KV heads cannot be split 3 ways; --tensor-parallel-size 1, 2 would work" in message
    assert "\n" not in message


def test_expert_parallel_needs_an_moe_model(llama: Path) -> None:
    with pytest.raises(ModelNotSupported, match="declares no expert-parallel plan"):
        build_engine(_config(llama, enable_expert_parallel=True))


def test_flags_that_do_not_go_with_it() -> None:
    assert "LoRA" in (EngineConfig(tensor_parallel_size=2, enable_lora=True).usage_problem() or "")
    assert "give 1" in (EngineConfig(tensor_parallel_size=0).usage_problem() or "")
    assert "needs --tensor-parallel-size" in (EngineConfig(enable_expert_parallel=True).usage_problem() or "")


def test_a_rank_that_cannot_start_is_one_line(split: LLMEngine, llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert split.runner.group is not None
    split.runner.group.stop()  # a process drives one group at a time: the module's goes first (this test runs last)
    # The fault (``tests/faults/sitecustomize.py``): rank 1 fails as it loads the model, as out of memory would.
    monkeypatch.syspath_prepend(str(FAULTS))
    monkeypatch.setenv("BATCHGEN_TEST_FAIL_RANK", "1")
    with pytest.raises(ModelLoadError) as failed:
        build_engine(_config(llama))
    assert str(failed.value) == "rank 1 of 2 could not start: injected: out of memory on rank 1"
    assert not torch.distributed.is_initialized()  # the driver left the group: another can start


@pytest.mark.slow  # a group each: about 6-12 s apiece on two shared cores
@pytest.mark.parametrize("model_type", sorted(SPLIT_ARCHITECTURES))
def test_other_architectures_split_two_ways(model_type: str, tmp_path: Path) -> None:
    # After the module's group has stopped (the test above): one group per process at a time.
    path = _build(model_type, SPLIT_ARCHITECTURES[model_type], build_tokenizer(), tmp_path)
    engine = build_engine(_config(path, enable_expert_parallel=EXPERT_PARALLEL[model_type]))
    assert isinstance(engine, LLMEngine) and engine.runner.group is not None
    if EXPERT_PARALLEL[model_type]:  # whole experts, half of them each
        experts = engine.runner.model.model.layers[1].mlp.experts.gate_up_proj
        assert experts.to_local().shape[0] == 2
    try:
        _check(engine, Reference(path))
    finally:
        engine.runner.group.stop()
