"""``--tensor-parallel-size 2`` on CPU (gloo): a tiny Llama split over two ranks, one process each, gives
transformers' greedy tokens, and its logprobs within 1e-4, through plain and chunked prefill and prefix-cache hits;
each rank holds half the KV heads and half of every split weight. A model that cannot be split is refused in one line
naming the sizes that work, before any rank starts. (Tests that start groups of their own are in
``test_tensor_parallel_families.py``: a process drives one group at a time, and this module's lives until its end.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_architectures import Reference, _build, _check

from batchgen.server.engine import EngineConfig, LLMEngine, build_engine
from batchgen.server.engine.demo_model import build_tokenizer
from batchgen.server.engine.errors import ModelNotSupported


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build("llama", {}, build_tokenizer(), tmp_path_factory.mktemp("llama"))


def config_of(path: Path, **overrides: Any) -> EngineConfig:
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
    engine = build_engine(config_of(llama))
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
        build_engine(config_of(llama, tensor_parallel_size=3))
    message = str(refused.value)
    assert "4 attention heads and 2 KV heads cannot be split 3 ways; --tensor-parallel-size 1, 2 would work" in message
    assert "\n" not in message


def test_expert_parallel_needs_an_moe_model(llama: Path) -> None:
    with pytest.raises(ModelNotSupported, match="declares no expert-parallel plan"):
        build_engine(config_of(llama, enable_expert_parallel=True))


def test_flags_that_do_not_go_with_it() -> None:
    assert "LoRA" in (EngineConfig(tensor_parallel_size=2, enable_lora=True).usage_problem() or "")
    assert "give 1" in (EngineConfig(tensor_parallel_size=0).usage_problem() or "")
    assert "needs --tensor-parallel-size" in (EngineConfig(enable_expert_parallel=True).usage_problem() or "")
