"""``--tensor-parallel-size 2`` on CPU (gloo): a tiny Llama split over two ranks, one process each, gives
transformers' greedy tokens, and its logprobs within 1e-4, through plain and chunked prefill and prefix-cache hits;
each rank holds half the KV heads and half of every split weight. LoRA adapters, each rank holding its shard of
them, mixed with the base in one batch give peft's greedy tokens and logprobs; a json_schema response format holds.
A model that cannot be split is refused in one line naming the sizes that work, before any rank starts. (Tests that
start groups of their own are in ``test_tensor_parallel_families.py``: a process drives one group at a time, and this
module's lives until its end.)"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_helpers import make_adapters, peft_model
from test_architectures import Reference, _build, _check, _run

from batchgen.schemas.requests import JsonSchemaFormat, ResponseFormat
from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams, build_engine
from batchgen.server.engine.errors import ModelNotSupported
from batchgen.server.engine.features.adapters import Adapters
from batchgen.server.engine.loading.demo_model import build_tokenizer
from batchgen.server.serving.structured import format_constraint


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
def adapters(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """peft's adapters on the Llama: on q and v (column-parallel), on every projection (rsLoRA), on o, up and down."""
    return make_adapters(llama, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def split(llama: Path, adapters: dict[str, Path]) -> Iterator[LLMEngine]:
    """One group of two ranks for the module, serving the adapters (its self-check, of the base and through an
    adapter's slot, runs at start)."""
    modules = tuple(f"{name}={adapters[name]}" for name in ("alpha", "beta"))  # gamma: loaded at run time
    engine = build_engine(config_of(llama, enable_lora=True, lora_modules=modules, max_loras=2, max_lora_rank=8))
    assert isinstance(engine, LLMEngine)
    yield engine
    assert engine.runner.group is not None
    engine.close()


def test_two_ranks_give_transformers_tokens_and_logprobs(split: LLMEngine, llama: Path) -> None:
    _check(split, Reference(llama))


def test_n_choices_fork_on_every_rank(split: LLMEngine, llama: Path) -> None:
    """``n`` > 1 forks a prompt's last, partly filled block: every rank copies its own share of it (the driver alone
    did, and 6 of 12 choices differed from transformers')."""
    _check(split, Reference(llama), n=3)


def test_each_rank_holds_its_share(split: LLMEngine, llama: Path) -> None:
    runner = split.runner
    assert [cache.shape[0] for cache in runner.cache.k] == [1, 1]  # 2 KV heads, one each
    q_proj = runner.model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.to_local().shape == (32, 64)  # 64 rows of query heads, half each
    assert runner.group is not None and not runner.group.broken


LORA_TOKENS = 6


@pytest.fixture(scope="module")
def peft_steps(llama: Path, adapters: dict[str, Path]) -> Callable[[list[int], str | None], list[torch.Tensor]]:
    """``steps(prompt, adapter)``: the log-softmax of each greedy step of peft's own forward through ``adapter``
    (``None``: the base)."""
    model = peft_model(llama, adapters)

    @torch.no_grad()
    def steps(prompt: list[int], adapter: str | None) -> list[torch.Tensor]:
        ids, found = list(prompt), []
        with model.disable_adapter() if adapter is None else nullcontext():
            if adapter is not None:
                model.set_adapter(adapter)
            for _ in range(LORA_TOKENS):
                found.append(torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], dim=-1))
                ids.append(int(found[-1].argmax()))
        return found

    return steps


def test_adapters_mixed_with_the_base_give_pefts_tokens_and_logprobs(
    split: LLMEngine, adapters: dict[str, Path], peft_steps: Callable[[list[int], str | None], list[torch.Tensor]]
) -> None:
    """Each rank holds its rows of B beside a column-parallel weight, its columns of A beside a row-parallel one
    (summed by the layer's all-reduce); a 30-token prompt is prefilled in chunks, and its second round hits the
    prefix cache under each adapter's own salt. Three adapters share two slots, so the ranks copy one over another
    mid-batch; the third is loaded at run time (as ``/v1/load_lora_adapter`` does): every rank reads its own shard."""
    assert split.lora is not None
    served = {adapter.name: adapter for adapter in split.served_adapters}
    served["gamma"] = Adapters("llama", 8).add("gamma", str(adapters["gamma"]))
    prompts = [[(7 * i + 3) % 250 for i in range(30)], [11, 12, 13, 14, 15]]
    params = SamplingParams(max_tokens=LORA_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=2)
    for round_ in range(2):
        requests = [
            EngineRequest(f"lora-{round_}-{i}-{name}", prompt, params, lora=served.get(name or ""))
            for i, prompt in enumerate(prompts)
            for name in (None, "alpha", "beta", "gamma")
        ]
        results = _run(split, requests)
        for request in requests:
            result = results[request.request_id]
            assert result.error is None, result.error
            name = request.lora.name if request.lora else None
            expected = peft_steps(request.prompt_token_ids, name)
            output = result.outputs[0]
            assert output.token_ids == [int(step.argmax()) for step in expected], request.request_id
            assert output.logprobs is not None
            for lp, step in zip(output.logprobs, expected, strict=True):
                for token_id, value in [(lp.token_id, lp.logprob), *lp.top]:
                    assert abs(value - step[token_id].item()) < 1e-4, request.request_id
            if round_ and len(request.prompt_token_ids) > 16:
                assert result.cached_tokens >= 16, "the prefix cache serves the adapter's own blocks"


def test_a_json_schema_response_format_holds_on_two_ranks(split: LLMEngine) -> None:
    """The driver samples every rank's logits under the grammar's mask."""
    schema = {
        "type": "object",
        "properties": {"c": {"enum": ["red", "green", "blue"]}},
        "required": ["c"],
        "additionalProperties": False,
    }
    response_format = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="s", schema_=schema))
    constraint = format_constraint(response_format)
    assert constraint is not None
    no_whitespace = {ord(c): -50.0 for c in " \t\r\n"}  # the demo tokenizer's byte tokens: the random model's
    # greedy choice would pad the document with every blank the grammar allows
    params = SamplingParams(max_tokens=40, grammar=constraint.grammar, logit_bias=no_whitespace)
    result = _run(split, [EngineRequest("json", [5, 6, 7, 8], params)])["json"]
    assert result.error is None, result.error
    assert result.outputs[0].finish_reason == "stop"
    text = split.tokenizer.decode(result.outputs[0].token_ids, skip_special_tokens=True)
    assert json.loads(text)["c"] in ("red", "green", "blue"), text


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
    assert EngineConfig(tensor_parallel_size=2, enable_lora=True).usage_problem() is None
    assert "give 1" in (EngineConfig(tensor_parallel_size=0).usage_problem() or "")
    assert "needs --tensor-parallel-size" in (EngineConfig(enable_expert_parallel=True).usage_problem() or "")
