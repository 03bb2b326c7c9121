"""The self-check reaches the model's own limits: a prompt past its longest sliding window (or sparse selection), so
an engine that gets the window wrong is refused at load, which the short prompts alone never show."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, self_check
from batchgen.server.engine.attention.layer import LayerAttention
from batchgen.server.engine.errors import ModelNotSupported
from batchgen.server.engine.self_check import check_engine

WINDOW = 40
"""Longer than every prompt of the short check (at most 35 tokens and 4 more with blocks of 16)."""


@pytest.fixture(scope="module")
def mistral(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = AutoConfig.for_model(
        "mistral",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=WINDOW,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mistral")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _engine(path: Path, tokenizer: Any, **overrides: Any) -> LLMEngine:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=64, **overrides)
    return LLMEngine(model, tokenizer, config, "mistral")


@pytest.fixture
def window_one_too_wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken engine: every query sees one key more than its window."""
    of = LayerAttention.of

    def wider(module: torch.nn.Module, attention_mask: object, kwargs: dict[str, Any]) -> LayerAttention:
        layer = of(module, attention_mask, kwargs)
        return layer if layer.window is None else dataclasses.replace(layer, window=layer.window + 1)

    monkeypatch.setattr(LayerAttention, "of", staticmethod(wider))


def test_the_check_runs_past_the_window(mistral: Path, tokenizer: Any) -> None:
    engine = _engine(mistral, tokenizer)
    lengths: list[int] = []
    add = engine.add_request

    def recorded(request: EngineRequest) -> None:
        lengths.append(len(request.prompt_token_ids))
        add(request)

    engine.add_request = recorded  # type: ignore[method-assign]
    check_engine(engine)
    assert max(lengths) == WINDOW + 16 + 3  # past the window by more than a block: its start moves across blocks
    # Its steps (compilations, logprobs, a small budget) are not serving's: the mixed-step bound learns nothing.
    assert engine.step_costs.prefill_token_s is None and engine.step_costs.decodes_s(1) == 0


def test_a_wrong_window_is_refused(mistral: Path, tokenizer: Any, window_one_too_wide: None) -> None:
    with pytest.raises(ModelNotSupported, match="MistralForCausalLM models: its logprobs through the engine differ"):
        check_engine(_engine(mistral, tokenizer))


def test_the_short_prompts_alone_miss_it(
    mistral: Path, tokenizer: Any, window_one_too_wide: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the check did before it reached the model's limits: the broken window passes."""
    monkeypatch.setattr(self_check, "mechanisms", lambda config, windows: [])
    check_engine(_engine(mistral, tokenizer))


def test_refused_when_the_budget_cannot_reach_it(mistral: Path, tokenizer: Any) -> None:
    with pytest.raises(ModelNotSupported) as refusal:
        check_engine(_engine(mistral, tokenizer, self_check_budget_s=1e-6))
    assert str(refusal.value).startswith(
        "batchgen cannot serve MistralForCausalLM models: the self-check cannot reach past its sliding window of "
        f"{WINDOW} tokens in time: a prompt of {WINDOW + 19} tokens would take about 0 s, over "
        "--self-check-budget-s 1e-06"
    )


@pytest.mark.parametrize(
    ("model_type", "extra", "expected"),
    [
        ("deepseek_v32", {"index_topk": 64}, ["its sparse attention's top-64 token selection (index_topk)"]),
        (
            "deepseek_v4",
            {"sliding_window": 128, "index_topk": 512},
            [
                "its compressed attention's stride of 4 tokens (compress_rates)",
                "its sliding window of 128 tokens",
                "its compressed attention's stride of 128 tokens (compress_rates)",
                "its sparse attention's top-512 token selection (index_topk)",
            ],
        ),
    ],
)
def test_what_the_config_declares(model_type: str, extra: dict[str, Any], expected: list[str]) -> None:
    """The sparse families' selections and strides, from their config classes; windows from what the probe saw."""
    config = AutoConfig.for_model(model_type, **extra)
    windows = {extra["sliding_window"], None} if "sliding_window" in extra else {None}
    assert [mechanism.what for mechanism in self_check.mechanisms(config, windows)] == expected


@pytest.fixture(scope="module")
def dsa_top40(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3.2 whose indexer keeps 40 tokens: every short prompt's context is all selected."""
    from sparse_models import build

    return build("deepseek_v32", tokenizer, tmp_path_factory.mktemp("dsa"), index_topk=WINDOW)


@pytest.fixture
def selection_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken engine: DSA layers attend to every causal token, as if the indexer selected them all."""
    from batchgen.server.engine.attention import step

    attend = step.attend_selected

    def dense(k: Any, v: Any, query: Any, layer: Any, selected: torch.Tensor, contexts: Any) -> torch.Tensor:
        everything = torch.arange(k.shape[1], dtype=selected.dtype).expand(selected.shape[0], -1)
        return attend(k, v, query, layer, everything, contexts)

    monkeypatch.setattr(step, "attend_selected", dense)


def test_the_check_runs_past_the_sparse_selection(dsa_top40: Path, tokenizer: Any) -> None:
    check_engine(_engine(dsa_top40, tokenizer))


def test_an_ignored_selection_is_refused(dsa_top40: Path, tokenizer: Any, selection_ignored: None) -> None:
    refusal = r"DeepseekV32ForCausalLM models: (greedy decoding|its logprobs) through the engine"
    with pytest.raises(ModelNotSupported, match=refusal):
        check_engine(_engine(dsa_top40, tokenizer))


def test_which_the_short_prompts_miss(
    dsa_top40: Path, tokenizer: Any, selection_ignored: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(self_check, "mechanisms", lambda config, windows: [])
    check_engine(_engine(dsa_top40, tokenizer))
