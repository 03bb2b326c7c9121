"""``--tensor-parallel-size 2`` with a group per test (a process drives one at a time: ``test_tensor_parallel.py``'s
lives until its module ends): a rank that cannot start is one line naming it, other architectures split two
ways give transformers' tokens and logprobs, and an MoE model in two pipeline stages does too."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lora_helpers import make_adapters
from test_architectures import ARCHITECTURES, Reference, _build, _check
from test_hybrid import FAMILIES as HYBRID_FAMILIES
from test_hybrid import GDN_KERNELS
from test_hybrid_lora import ADAPTERS, PROMPTS, peft_generate
from test_tensor_parallel import config_of, llama
from test_vision_language import CONVERSATIONS, Family, _run, _same
from vlm_helpers import BUILDERS

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams, build_engine
from batchgen.server.engine.errors import ModelLoadError
from batchgen.server.engine.features.adapters import Adapters
from batchgen.server.engine.loading.demo_model import build_tokenizer
from batchgen.server.engine.loading.split import split_state_problem

FAULTS = Path(__file__).resolve().parents[1] / "faults"

__all__ = ["llama"]  # the fixture, shared

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


def test_a_rank_that_cannot_start_is_one_line(llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The fault (``tests/faults/sitecustomize.py``): rank 1 fails as it loads the model, as out of memory would.
    monkeypatch.syspath_prepend(str(FAULTS))
    monkeypatch.setenv("BATCHGEN_TEST_FAIL_RANK", "1")
    with pytest.raises(ModelLoadError) as failed:
        build_engine(config_of(llama))
    assert str(failed.value) == "rank 1 of 2 could not start: injected: out of memory on rank 1"
    assert not torch.distributed.is_initialized()  # the driver left the group: another can start


@pytest.mark.slow  # a group each: about 6-12 s apiece on two shared cores
@pytest.mark.parametrize("model_type", sorted(SPLIT_ARCHITECTURES))
def test_other_architectures_split_two_ways(model_type: str, tmp_path: Path) -> None:
    path = _build(model_type, SPLIT_ARCHITECTURES[model_type], build_tokenizer(), tmp_path)
    engine = build_engine(config_of(path, enable_expert_parallel=EXPERT_PARALLEL[model_type]))
    assert isinstance(engine, LLMEngine) and engine.runner.group is not None
    if EXPERT_PARALLEL[model_type]:  # whole experts, half of them each
        experts = engine.runner.model.model.layers[1].mlp.experts.gate_up_proj
        assert experts.to_local().shape[0] == 2
    try:
        _check(engine, Reference(path))
    finally:
        engine.close()


def test_an_moe_model_in_two_stages(tmp_path: Path) -> None:
    """Qwen3-MoE's layers in two stages (``--pipeline-parallel-size 2``), with preemption (14 blocks of 8 tokens)."""
    path = _build("qwen3_moe", SPLIT_ARCHITECTURES["qwen3_moe"], build_tokenizer(), tmp_path)
    config = config_of(path, tensor_parallel_size=1, pipeline_parallel_size=2, block_size=8, num_kv_blocks=14)
    engine = build_engine(config)
    assert isinstance(engine, LLMEngine) and engine.runner.group is not None
    try:
        _check(engine, Reference(path))
        assert engine.scheduler.num_preemptions > 0
        assert len(engine.runner.cache.k) == 1  # the driver's stage: one of the two layers
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["qwen2_5_vl", "kimi_k25", "gemma3"])
def test_images_on_two_ranks(tmp_path: Path, name: str) -> None:
    """Split two ways, the driver encodes the pictures, every rank takes their rows (and M-RoPE's positions) into the
    embeddings it looks up with the others (the vocabulary is split): transformers' tokens and logprobs. Qwen2.5-VL;
    the seed's Kimi K2.5 (MoonViT beside DeepSeek-V3's MLA and routed experts, the experts spread over the ranks)
    with n = 2; Gemma 3, whose image tokens attend both ways (each rank masks them so: the step carries the spans;
    it was refused). The driver once looked them up alone, a collective the ranks never joined (every image chat
    answered 500 after 30 s)."""
    family = Family(name, BUILDERS[name](tmp_path / name))
    experts = name == "kimi_k25"
    config = config_of(family.path, max_num_batched_tokens=2048, num_kv_blocks=64, enable_expert_parallel=experts)
    engine = build_engine(config)
    assert isinstance(engine, LLMEngine) and engine.runner.group is not None
    try:
        if experts:  # whole experts, half of them each
            assert engine.runner.model.model.language_model.layers[1].mlp.experts.gate_up_proj.to_local().shape[0] == 2
        n = 2 if experts else 1
        results = _run(engine, [family.request(i, f"r{i}", n=n) for i in range(len(CONVERSATIONS))])
        for i in range(len(CONVERSATIONS)):
            assert len(results[f"r{i}"].outputs) == n
            _same(family, results[f"r{i}"], i)
    finally:
        engine.close()


GDN_ADAPTERS = {
    "qwen3_5_text": ADAPTERS["qwen3_5_text"]["gdn"],
    "qwen3_next": {"r": 8, "lora_alpha": 16, "target_modules": ["in_proj_qkvz", "in_proj_ba", "out_proj"]},
    "olmo_hybrid": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "g_proj", "b_proj", "o_proj"]},
    "kimi_linear": {"r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "b_proj", "f_b_proj", "g_b_proj"]},
    "granitemoehybrid": {"r": 8, "lora_alpha": 4, "target_modules": ["in_proj", "out_proj"]},
}
"""An adapter on the linear attention's linears: Qwen3.5's projections one by one, Qwen3-Next's fused by key head,
OLMo hybrid's each a projection of its own (and its attention's q, v and o beside them), Kimi Delta Attention's
(its gates' second, split halves), Granite 4's Mamba 2 projections."""
ONE_GROUP = {"granitemoehybrid": {"mamba_n_groups": 1}}
"""Granite 4 as its checkpoints are, one group of B and C for all its Mamba heads: each rank keeps it whole (the split
of groups, Nemotron-H's eight, was checked by hand)."""


@pytest.mark.parametrize("name", sorted(GDN_ADAPTERS))
def test_a_hybrid_model_on_two_ranks(tmp_path: Path, name: str) -> None:
    """Qwen3.5's, Qwen3-Next's and OLMo hybrid's Gated DeltaNet layers, Kimi Linear's Delta Attention and Granite 4's
    Mamba 2 beside attention, split two ways by heads (vLLM's split): each rank its key heads' query and key, its
    value heads' value, gate and decay (Mamba's: its heads' one group of B and C, whole), their convolution channels
    and its share of the state, the partial outputs summed; the state laid out by the driver (the channel sends each
    step's state layout, and each slot copy: a fork's, a checkpoint's restored). The base and an adapter on the
    linear attention's linears (each rank its heads' rows or columns of it) mixed in one batch, peft's tokens and
    logprobs (on the CPU kernels where the family has them); and for Qwen3.5 transformers' with n = 2 and prefix
    hits. A rank once died at start (its mixers had no layout); then every rank ran the whole recurrence over a
    whole copy of the state."""
    spec = {**HYBRID_FAMILIES[name], **ONE_GROUP.get(name, {})}
    path = _build(name, spec, build_tokenizer(), tmp_path / "model")
    adapters = make_adapters(path, tmp_path, {"gdn": GDN_ADAPTERS[name]})
    lora = {"enable_lora": True, "lora_modules": (f"gdn={adapters['gdn']}",), "max_loras": 1, "max_lora_rank": 8}
    engine = build_engine(config_of(path, **lora))
    assert isinstance(engine, LLMEngine) and engine.runner.group is not None
    states = engine.runner.states
    assert states is not None and engine.runner.split_heads == 2
    assert all(states.mixers.fast) == (name in GDN_KERNELS)  # the others through their own forwards
    heads = spec.get("linear_num_value_heads") or spec.get("linear_num_heads") or spec["mamba_n_heads"]  # whole
    recurrent = [state for layer in states.layers for state in layer.states if state.key[1] == "recurrent"]
    assert recurrent and all(state.shape[0] == heads // 2 for state in recurrent)
    try:
        if name == "qwen3_5_text":  # forks and prefix checkpoints over a split state (the same for every family)
            _check(engine, Reference(path), n=2)
            assert states.slots.published > 0  # the second wave's prompts hit a checkpoint
        params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True)
        adapter = Adapters(name, 8, lora["lora_modules"]).get("gdn")
        requests = {(p, a): EngineRequest(f"{p}-{a}", list(p), params, lora=adapter if a else None)
                    for p in PROMPTS for a in (None, "gdn")}  # fmt: skip
        results = _run(engine, list(requests.values()))
        reference = peft_generate(path, adapters)
        texts = set()
        for (prompt, name_), request in requests.items():
            tokens, logprobs = reference(prompt, name_)
            output = results[request.request_id].outputs[0]
            assert output.token_ids == tokens and output.logprobs is not None, request.request_id
            assert all(abs(lp.logprob - logprobs[t][lp.token_id].item()) < 1e-4 for t, lp in enumerate(output.logprobs))
            texts.add((prompt, tuple(tokens)))
        assert len(texts) > len(PROMPTS)  # the adapter changes a text
    finally:
        engine.close()


def test_state_layers_split_only_where_every_rank_holds_the_whole_state() -> None:
    """A state layer whose projection a plan splits without gathering it back is refused in one line naming what."""

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.in_proj = torch.nn.Linear(2, 2)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Layer()])
    model._tp_plan = {"layers.*.in_proj": "colwise"}
    layers = [SimpleNamespace(module=model.layers[0])]
    split = split_state_problem(model, layers, EngineConfig(tensor_parallel_size=2))
    assert (
        split is not None
        and "layers.0.in_proj is split by its tensor-parallel plan (layers.*.in_proj: colwise)" in split
    )
    model._tp_plan = {"layers.*.in_proj": "colwise_gather_output"}
    assert split_state_problem(model, layers, EngineConfig(tensor_parallel_size=2)) is None


def test_a_hybrid_model_in_two_stages(tmp_path: Path) -> None:
    """Qwen3.5 in two stages, its state layer in the second: the driver's stage holds none, keeps the slots' books
    and lays out each step's state, which the second follows over its own state cache (each stage its layers' state).
    Transformers' tokens and logprobs with n = 2 and prefix checkpoints. Stages of a hybrid model were refused (and
    before that, a stage without state layers waited for the others' probe forward until the group's timeout)."""
    layer_types = ["full_attention", "full_attention", "linear_attention", "full_attention"]
    spec = {**HYBRID_FAMILIES["qwen3_5_text"], "layer_types": layer_types}
    path = _build("qwen3_5_text", spec, build_tokenizer(), tmp_path)
    engine = build_engine(config_of(path, tensor_parallel_size=1, pipeline_parallel_size=2))
    assert isinstance(engine, LLMEngine) and engine.runner.group is not None
    states = engine.runner.states
    assert states is not None and not states.layers  # the driver's stage: attention alone
    try:
        _check(engine, Reference(path), n=2)
        assert states.slots.published > 0  # the second wave's prompts hit a checkpoint
    finally:
        engine.close()


def test_a_sparse_attention_model_on_two_ranks(tmp_path: Path) -> None:
    """DeepSeek-V3.2's lightning indexer beside MLA and experts, split two ways: every rank's indexer picks the same
    past tokens for its heads' share of the attention, and the tokens and logprobs are transformers'."""
    from sparse_models import build

    path = build("deepseek_v32", build_tokenizer(), tmp_path)
    engine = build_engine(config_of(path))
    assert isinstance(engine, LLMEngine) and engine.runner.group is not None and engine.runner.sparse
    try:
        _check(engine, Reference(path))
    finally:
        engine.close()
