"""LoRA adapters on hybrid models (``engine/features/lora.py`` over ``engine/features/state/``): adapters made with
peft on a tiny Qwen3.5 (its Gated DeltaNet layers on the engine's fast path, projections on the whole packed row), and
tiny Nemotron-H and LFM2 (their Mamba2 layers and short convolutions through the layer's own forward per sequence piece
and for the step's decodes, each call on some of the step's rows; Nemotron-H's MLP-only layers), two adapters and the
base mixed in one batch with chunked prefill: the same greedy tokens as peft's ``generate`` and logprobs within 1e-4
(float32); an adapter on a convolution is refused by name."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_helpers import make_adapters, peft_model
from test_architectures import _build
from test_hybrid import FAMILIES
from transformers import AutoModelForCausalLM

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from batchgen.server.engine.features.adapters import AdapterRefused, Adapters, adapter_config
from batchgen.server.engine.loading.demo_model import build_tokenizer
from batchgen.server.engine.self_check import check_engine

TOKENS = 6
PROMPTS = ((5, 80, 17, 3, 250), tuple(range(30, 53)), tuple(range(200, 161, -1)))
"""Lengths 5, 23 and 39: with chunks of 16, prompts continued at another offset than a block's."""
ADAPTERS: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3_5_text": {
        "attn": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]},
        "gdn": {  # every linear of the Gated DeltaNet layers, and one of the MLP's
            "r": 8,
            "lora_alpha": 16,
            "use_rslora": True,
            "target_modules": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "up_proj"],
        },
    },
    "nemotron_h": {  # peft refuses Mamba's out_proj here; its layer 2 is an MLP alone (neither attention nor state)
        "attn": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]},
        "mamba": {"r": 8, "lora_alpha": 4, "target_modules": ["in_proj", "down_proj"]},
    },
    "lfm2": {
        "attn": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "w1", "w2"]},
        "conv": {"r": 8, "lora_alpha": 4, "target_modules": ["in_proj", "out_proj", "w3"]},  # out_proj: conv and attn
    },
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module", params=sorted(ADAPTERS))
def family(request: pytest.FixtureRequest, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp(request.param)
    path = _build(request.param, FAMILIES[request.param], tokenizer, root / "model")
    return request.param, path, make_adapters(path, root, ADAPTERS[request.param])


def peft_generate(path: Path, adapters: dict[str, Path]) -> Callable[[tuple[int, ...], str | None], Any]:
    """``peft_model``'s ``generate``, greedy: the tokens and the log-softmax of the logits that chose each."""
    model = peft_model(path, adapters)

    @torch.no_grad()
    def generate(prompt: tuple[int, ...], adapter: str | None) -> tuple[list[int], torch.Tensor]:
        ids = torch.tensor([prompt])
        with model.disable_adapter() if adapter is None else contextlib.nullcontext():
            if adapter is not None:
                model.set_adapter(adapter)
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
        return out.sequences[0, len(prompt) :].tolist(), torch.log_softmax(torch.stack(out.logits)[:, 0], dim=-1)

    return generate


def test_a_mix_of_adapters_and_the_base_is_peft_token_for_token(family: Any, tokenizer: Any) -> None:
    name, path, adapters = family
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = EngineConfig(
        model=str(path), dtype="float32", device="cpu", num_kv_blocks=128, block_size=8, max_num_batched_tokens=16,
        enable_lora=True, lora_modules=tuple(f"{a}={p}" for a, p in adapters.items()), max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    engine = LLMEngine(model, tokenizer, config, name)
    check_engine(engine)  # as the factory does: the base, then the first adapter through the slots
    paths = dict(p.state() for p in engine.runner.paths)
    assert ("Gated DeltaNet kernels" in paths) == (name == "qwen3_5_text") and not any(paths.values()), paths
    served = Adapters(name, 8, config.lora_modules)
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=True, top_logprobs=2)
    requests = [
        EngineRequest(f"{i}-{a}", list(prompt), params, lora=served.get(a) if a else None)
        for i, prompt in enumerate(PROMPTS)
        for a in (None, *adapters)
    ]
    for request in requests:
        engine.add_request(request)
    results = {}
    while engine.has_unfinished_requests():
        results.update((r.request_id, r) for r in engine.step())
    reference = peft_generate(path, adapters)
    texts = set()
    for request in requests:
        result = results[request.request_id]
        assert result.error is None, result.error
        output = result.outputs[0]
        tokens, logprobs = reference(tuple(request.prompt_token_ids), request.lora.name if request.lora else None)
        assert output.token_ids == tokens, request.request_id
        assert output.logprobs is not None
        for lp, expected in zip(output.logprobs, logprobs, strict=True):
            assert abs(lp.logprob - expected[lp.token_id].item()) < 1e-4, request.request_id
            assert all(abs(value - expected[token].item()) < 1e-4 for token, value in lp.top), request.request_id
        texts.add((request.prompt_token_ids[0], tuple(tokens)))
    assert len(texts) == len(requests), "an adapter left a text unchanged"
    assert engine.lora is not None and engine.lora.users == [0, 0, 0]


CONVOLUTIONS = {"qwen3_5_text": "conv1d", "lfm2": "conv.conv"}
"""A state layer's convolution that peft adapts (peft makes no adapter on a Mamba layer's)."""


@pytest.mark.parametrize("family", sorted(CONVOLUTIONS), indirect=True)
def test_an_adapter_on_a_convolution_is_refused_by_name(family: Any, tmp_path: Path) -> None:
    name, path, _ = family
    module = CONVOLUTIONS[name]
    # peft takes a grouped (depthwise) convolution at a rank its groups divide (64 or 128 channels here).
    adapter = make_adapters(path, tmp_path, {"x": {"r": 128, "target_modules": [module, "q_proj"]}})["x"]
    refusal = f"LoRA adapter 'x' cannot be served: it adapts a convolution \\(.*{module}\\)"
    with pytest.raises(AdapterRefused, match=refusal):
        adapter_config("x", adapter, 128)
