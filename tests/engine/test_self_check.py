"""The load-time self-check refuses a model the engine would serve wrongly, whatever its architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, LlamaForCausalLM, LlamaModel

from batchgen.server.engine import EngineConfig, LLMEngine, factory
from batchgen.server.engine.errors import ModelNotSupported
from batchgen.server.engine.self_check import check_engine


class TokenShiftModel(LlamaModel):
    """Each token also sees its predecessor's embedding, outside attention (as RWKV-style token shifts do): right
    for a whole sequence, wrong for a packed step or a single decode token."""

    def forward(self, input_ids: Any = None, inputs_embeds: Any = None, **kwargs: Any) -> Any:
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        previous = torch.nn.functional.pad(inputs_embeds[:, :-1], (0, 0, 1, 0))
        return super().forward(inputs_embeds=inputs_embeds + previous, **kwargs)


class TokenShiftForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = TokenShiftModel(config)
        self.post_init()


def _config(**overrides: Any) -> EngineConfig:
    return EngineConfig(model="demo", dtype="float64", device="cpu", **{"num_kv_blocks": 64, **overrides})


def test_a_model_the_engine_cannot_drive_is_refused(
    demo_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The factory checks the engine it builds."""
    torch.manual_seed(0)
    model = TokenShiftForCausalLM(AutoConfig.from_pretrained(demo_path)).to(torch.float64).eval()
    monkeypatch.setattr(factory, "load_model", lambda config, model_class=None: (model, tokenizer))
    with pytest.raises(ModelNotSupported, match=r"TokenShiftForCausalLM models: .*own forward"):
        factory.build_engine(_config())
    factory.build_engine(_config(self_check=False))  # the flag skips it, at the user's risk


def test_the_self_check_leaves_nothing_behind(engine_model: Any, tokenizer: Any) -> None:
    engine = LLMEngine(engine_model, tokenizer, _config(), "demo")
    check_engine(engine)
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert (stats.prompt_tokens, stats.generated_tokens, stats.running, stats.queued) == (0, 0, 0, 0)
    assert stats.kv_blocks_free == stats.kv_blocks_total
