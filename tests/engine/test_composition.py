"""Features composed: every pair of the engine's features that a user may ask for together is exact (against
transformers, peft or one rank) or refused at start-up in one line naming both. ``MATRIX`` says where each cell is
shown; the cells no other module covers run here: a hybrid model's adapter through prefix checkpoints and
preemption, an adapter on a vision-language model under a grammar, and the refusals made before any rank starts."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch
from test_architectures import _build
from test_hybrid import FAMILIES as HYBRID_FAMILIES
from test_hybrid_lora import peft_generate
from test_vision_language import CONVERSATIONS, PICTURES, Family, _run

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams, build_engine
from batchgen.server.engine.errors import ModelLoadError
from batchgen.server.engine.features.adapters import Adapters
from batchgen.server.engine.loading.demo_model import build_tokenizer

MATRIX: dict[tuple[str, str], str] = {
    ("tensor parallel", "images"): "test_tensor_parallel_families.py::test_images_on_two_ranks",
    ("pipeline parallel", "images"): "test_composition.py::test_stages_of_a_vision_language_model_are_refused",
    ("tensor parallel", "images attending both ways"): "test_tensor_parallel_families.py::test_images_on_two_ranks",
    ("tensor parallel", "Gemma 4 images"): "test_composition.py::test_gemma_4_images_split_are_refused",
    ("tensor parallel x expert parallel", "images x MLA"): "test_tensor_parallel_families.py::test_images_on_two_ranks",
    ("tensor parallel", "hybrid"): "test_tensor_parallel_families.py::test_a_hybrid_model_on_two_ranks",
    ("tensor parallel", "hybrid split by heads x LoRA"): (
        "test_tensor_parallel_families.py::test_a_hybrid_model_on_two_ranks"
    ),
    ("pipeline parallel", "hybrid"): "test_tensor_parallel_families.py::test_a_hybrid_model_in_two_stages",
    ("tensor parallel", "DSA"): "test_tensor_parallel_families.py::test_a_sparse_attention_model_on_two_ranks",
    ("tensor parallel", "LoRA"): (
        "test_tensor_parallel.py::test_adapters_mixed_with_the_base_give_pefts_tokens_and_logprobs"
    ),
    ("pipeline parallel", "LoRA"): "test_pipeline_parallel.py::test_each_stage_holds_its_layers_adapters",
    ("tensor parallel", "structured outputs"): (
        "test_tensor_parallel.py::test_a_json_schema_response_format_holds_on_two_ranks"
    ),
    ("tensor parallel", "n > 1"): "test_tensor_parallel.py::test_n_choices_fork_on_every_rank",
    ("pipeline parallel", "n > 1"): "test_pipeline_parallel.py::test_n_choices_fork_in_every_stage",
    ("tensor parallel", "a restart"): (
        "../reliability/test_tensor_parallel_faults.py::"
        "test_a_killed_rank_restarts_the_group_and_every_line_is_answered_once"
    ),
    ("pipeline parallel", "a restart"): (
        "test_pipeline_parallel.py::test_a_killed_stage_fails_the_group_which_comes_back_whole"
    ),
    ("tensor parallel", "pooling"): "test_composition.py::test_a_pooling_model_split_is_refused",
    (
        "tensor parallel",
        "quantization",
    ): "test_quantized.py::test_what_cannot_run_on_cpu_is_refused_by_name_in_one_line",
    ("hybrid", "LoRA x prefix checkpoints x preemption"): (
        "test_composition.py::test_a_hybrid_models_adapter_through_checkpoints_and_preemption"
    ),
    ("hybrid", "n > 1 x preemption"): "test_hybrid.py::test_preemption_recomputes_the_state",
    ("images", "LoRA x structured outputs"): "test_composition.py::test_an_adapter_with_images_under_a_grammar",
    ("images", "structured outputs"): "../server/test_server_images.py::test_limits",
    ("DSA", "prefix x chunks"): "test_dsa.py::test_chunked_prefill_small_blocks_and_n",
    ("replicas", "images x hybrid"): (
        "../replicas/test_replicas_hybrid_images.py::test_image_lines_are_spread_over_both_replicas_and_equal_generate"
    ),
}
"""Each cell (a pair of features, or more) -> the test that shows it exact or refused in one line."""


def test_every_cell_is_shown_by_a_test() -> None:
    here = Path(__file__).parent
    for cell, where in MATRIX.items():
        path, name = where.split("::")
        module = (here / path).resolve()
        assert module.is_file(), (cell, where)
        assert f"def {name}(" in module.read_text(), (cell, where)


def test_stages_of_a_vision_language_model_are_refused(tmp_path: Path) -> None:
    """Its stages would split the language model alone: refused in one line before any rank starts."""
    from vlm_helpers import qwen2_5_vl

    path = qwen2_5_vl(tmp_path / "qwen2_5_vl")
    with pytest.raises(ModelLoadError) as refused:
        build_engine(EngineConfig(model=str(path), device="cpu", dtype="float32", pipeline_parallel_size=2))
    said = str(refused.value)
    assert "pipeline stages" in said and "\n" not in said
    assert not torch.distributed.is_initialized()


def test_gemma_4_images_split_are_refused(tmp_path: Path) -> None:
    """transformers' Gemma 4 forward cannot run split (it mixes distributed tensors with plain ones): refused in one
    line, from the config, before any rank starts (a rank once died at its layer probe with aten's words)."""
    from transformers import AutoConfig

    from batchgen.server.engine.errors import ModelNotSupported

    config = AutoConfig.for_model("gemma4")
    config.architectures = ["Gemma4ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelNotSupported) as refused:
        build_engine(EngineConfig(model=str(tmp_path), device="cpu", tensor_parallel_size=2))
    said = str(refused.value)
    assert said.startswith("batchgen cannot serve Gemma4ForConditionalGeneration models: transformers' Gemma 4")
    assert said.endswith("serve it on one device") and "\n" not in said
    assert not torch.distributed.is_initialized()


def test_a_pooling_model_split_is_refused(tmp_path: Path) -> None:
    """An embedding model, a classifier or a reranker runs in one process: a split is refused in one line."""
    path = _build("llama", {}, build_tokenizer(), tmp_path)
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", task="embed", tensor_parallel_size=2)
    with pytest.raises(ModelLoadError) as refused:
        build_engine(config)
    assert str(refused.value) == "--tensor-parallel-size 2: encoder and pooling models are served by one process"


def test_a_hybrid_models_adapter_through_checkpoints_and_preemption(tmp_path: Path) -> None:
    """Qwen3.5 with an adapter on its Gated DeltaNet and attention layers, two waves of prompts under one shared
    prefix (the second's prefix hits start from the first's state checkpoints), in so few KV blocks that sequences
    are preempted and recomputed: peft's greedy tokens and logprobs, each choice."""
    from lora_helpers import make_adapters
    from test_hybrid_lora import ADAPTERS, TOKENS

    tokenizer = build_tokenizer()
    path = _build("qwen3_5_text", HYBRID_FAMILIES["qwen3_5_text"], tokenizer, tmp_path / "model")
    adapters = make_adapters(path, tmp_path, ADAPTERS["qwen3_5_text"])  # the factory's self-check runs "attn"
    config = EngineConfig(
        model=str(path), dtype="float32", device="cpu", num_kv_blocks=7, block_size=8, max_num_batched_tokens=32,
        enable_lora=True, lora_modules=tuple(f"{name}={adapter}" for name, adapter in adapters.items()), max_loras=2,
        max_lora_rank=8,
    )  # fmt: skip
    engine = build_engine(config)
    assert isinstance(engine, LLMEngine) and engine.runner.states is not None
    rng = random.Random(3)
    shared = [rng.randrange(256) for _ in range(24)]
    waves = [[(*shared, *(rng.randrange(256) for _ in range(n))) for n in (3, 9, 14)] for _ in range(2)]
    served = Adapters("m", 8, config.lora_modules).get("gdn")
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=True)
    reference = peft_generate(path, adapters)
    for wave, prompts in enumerate(waves):
        requests = [
            EngineRequest(f"{wave}-{i}-{lora}", list(prompt), params, lora=served if lora else None)
            for i, prompt in enumerate(prompts)
            for lora in (False, True)
        ]
        results = _run(engine, requests)
        for request in requests:
            result = results[request.request_id]
            assert result.error is None, result.error
            tokens, logprobs = reference(tuple(request.prompt_token_ids), "gdn" if request.lora else None)
            output = result.outputs[0]
            assert output.token_ids == tokens, request.request_id
            assert output.logprobs is not None
            for lp, expected in zip(output.logprobs, logprobs, strict=True):
                assert abs(lp.logprob - expected[lp.token_id].item()) < 1e-4, request.request_id
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.cached_tokens > 0 and stats.state_checkpoints > 0


CHOICES = ["a red cat", "a blue dog", "a green bird"]


def test_an_adapter_with_images_under_a_grammar(tmp_path: Path) -> None:
    """LLaVA with an adapter on its language model, a picture in the prompt and a choice grammar: the engine's text
    is peft's greedy decoding of the same picture, each step's choice the most likely of the tokens the grammar
    allows (the reference masks peft's logits with llguidance's own masks)."""
    from vlm_helpers import llava_adapter

    path, peft = llava_adapter(tmp_path, seed=11)
    family = Family("llava", path)
    grammar = llguidance.grammar_from("choice", CHOICES)  # type: ignore[arg-type]
    engine = family.engine(enable_lora=True, lora_modules=(f"a={tmp_path / 'adapter'}",), max_lora_rank=8)
    request = family.request(1, "lora", pictures=[2])
    request.lora = Adapters.of(engine.config).get("a")
    request.params = dataclasses.replace(request.params, grammar=grammar, max_tokens=40, logprobs=False)
    result = _run(engine, [request])["lora"]
    assert result.error is None, result.error
    text = family.processor.processor.tokenizer.decode(result.outputs[0].token_ids, skip_special_tokens=True)
    assert text == _constrained_greedy(peft, family, grammar) and text in CHOICES


@torch.no_grad()
def _constrained_greedy(model: Any, family: Family, grammar: str) -> str:
    """The model's greedy decoding of conversation 1 with picture 2, each token the most likely the grammar allows,
    until the grammar is done."""
    processor = family.processor.processor
    tokenizer = processor.tokenizer
    messages = [{"role": "user", "content": CONVERSATIONS[1]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[PICTURES[2]], return_tensors="pt", add_special_tokens=False)
    vocab = model.get_output_embeddings().weight.shape[0]
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab), grammar)
    masks = llguidance.torch.allocate_token_bitmask(1, vocab)
    ids = inputs["input_ids"]
    chosen: list[int] = []
    while not matcher.is_stopped() and len(chosen) < 40:
        logits = model(**{**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}).logits[0, -1]
        llguidance.torch.fill_next_token_bitmask(matcher, masks, 0)
        llguidance.torch.apply_token_bitmask_inplace(logits, masks)
        token = int(logits.argmax())
        if token == tokenizer.eos_token_id:
            break
        matcher.consume_token(token)
        chosen.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return str(tokenizer.decode(chosen, skip_special_tokens=True))
