"""``--pipeline-parallel-size 2`` on CPU (gloo): a tiny Llama's two layers in two stages, one process each, give
transformers' greedy tokens and its logprobs within 1e-4 through chunked prefill, prefix-cache hits and preemption
(too few KV blocks for every prompt at once); each stage holds its own layer, its layer's KV cache, and the
embeddings or the norm and head. A layout that cannot be split is refused before any rank starts, in one line naming
the sizes that work. (The MoE family in stages: ``test_tensor_parallel_families.py``, a group per test.)"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from test_architectures import NEW_TOKENS, Reference, _check, _engine, _prompts, _run
from test_tensor_parallel import LORA_TOKENS, adapters, config_of, llama, peft_steps
from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams, build_engine
from batchgen.server.engine.errors import GroupFailed, ModelNotSupported
from batchgen.server.engine.loading.demo_model import build_tokenizer

__all__ = ["adapters", "llama", "peft_steps"]  # the fixtures, shared

STAGES = {"tensor_parallel_size": 1, "pipeline_parallel_size": 2}


@pytest.fixture(scope="module")
def staged(llama: Path, adapters: dict[str, Path]) -> Iterator[LLMEngine]:
    """One group of two stages for the module, serving a LoRA adapter on every projection; 14 blocks of 8 tokens:
    the first wave's prompts need 27."""
    lora = {"enable_lora": True, "lora_modules": (f"beta={adapters['beta']}",), "max_loras": 1, "max_lora_rank": 8}
    engine = build_engine(config_of(llama, **STAGES, block_size=8, num_kv_blocks=14, **lora))
    assert isinstance(engine, LLMEngine)
    yield engine
    assert engine.runner.group is not None
    engine.close()


def test_two_stages_give_transformers_tokens_and_logprobs(staged: LLMEngine, llama: Path) -> None:
    _check(staged, Reference(llama))  # chunked prefill (24-token steps), and the second wave's prefix hits
    assert staged.scheduler.num_preemptions > 0


def test_n_choices_fork_in_every_stage(staged: LLMEngine, llama: Path) -> None:
    """Each stage copies its own layers' share of a forked block (the driver's stage alone did)."""
    _check(staged, Reference(llama), n=2)


def test_each_stage_holds_its_layers_adapters(
    staged: LLMEngine, peft_steps: Callable[[list[int], str | None], list[torch.Tensor]]
) -> None:
    """The adapter's matrices for the second stage's layer are checked on the first too (the same verdict on every
    stage), and kept by the second; beside a base request, peft's greedy tokens and logprobs."""
    assert staged.lora is not None
    assert set(staged.lora.elsewhere) >= {"model.layers.1.self_attn.o_proj", "model.layers.1.mlp.down_proj"}
    assert all(name.startswith("model.layers.0.") for name in staged.lora.weights(staged.served_adapters[0]).matrices)
    prompt = [11, 12, 13, 14, 15, 16]
    params = SamplingParams(max_tokens=LORA_TOKENS, ignore_eos=True, logprobs=True)
    requests = [
        EngineRequest("base", prompt, params),
        EngineRequest("beta", prompt, params, lora=staged.served_adapters[0]),
    ]
    results = _run(staged, requests)
    for request in requests:
        expected = peft_steps(prompt, request.lora.name if request.lora else None)
        output = results[request.request_id].outputs[0]
        assert output.token_ids == [int(step.argmax()) for step in expected], request.request_id
        assert output.logprobs is not None
        for lp, step in zip(output.logprobs, expected, strict=True):
            assert abs(lp.logprob - step[lp.token_id].item()) < 1e-4


def test_each_stage_holds_its_layers(staged: LLMEngine) -> None:
    runner = staged.runner
    model = runner.model  # the driver's: the first stage
    assert not isinstance(model.model.layers[0], PipelineIdentityLayer)
    assert isinstance(model.model.layers[1], PipelineIdentityLayer)  # the second stage's: never loaded here
    assert isinstance(model.lm_head, PipelineIdentityLayer) and isinstance(model.model.norm, PipelineIdentityLayer)
    assert len(runner.cache.k) == 1 and runner.cache.k[0].shape[0] == 2  # its layer's cache, every KV head
    assert runner.group is not None and not runner.group.broken


def test_an_embedding_is_the_last_stages(staged: LLMEngine, llama: Path) -> None:
    """``/v1/embeddings`` on a generative model: the hidden states the last stage ends with, as one process's."""
    prompt = list(_prompts()[2])
    (split,) = _run(staged, [EngineRequest("e", prompt, task="embed")]).values()
    (whole,) = _run(_engine(llama, build_tokenizer()), [EngineRequest("e", prompt, task="embed")]).values()
    assert split.embedding is not None and whole.embedding is not None
    assert np.abs(np.asarray(split.embedding) - np.asarray(whole.embedding)).max() < 1e-5


def test_a_killed_stage_fails_the_group_which_comes_back_whole(
    staged: LLMEngine, llama: Path, peft_steps: Callable[[list[int], str | None], list[torch.Tensor]]
) -> None:
    """The same fault path as a killed tensor-parallel rank (the server's side of it, every line answered once:
    ``tests/reliability/test_tensor_parallel_faults.py``): the step fails as the group's, naming the stage's rank,
    and the engine's reset starts both stages again, which then give the same tokens, the adapter's included (its
    slots are the new shards')."""
    group = staged.runner.group
    assert group is not None
    prompt = _prompts()[1]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    staged.add_request(EngineRequest("killed", list(prompt), params))
    staged.step()
    (stage,) = group.processes
    stage.kill()  # SIGKILL, as the OOM killer would
    began = time.monotonic()
    with pytest.raises(GroupFailed, match=r"pipeline-parallel group of 2 ranks failed: rank 1 exited \(signal 9\)"):
        while staged.has_unfinished_requests():
            staged.step()
    assert time.monotonic() - began < 2.0
    staged.reset()  # what the engine worker does after a failure
    assert staged.runner.group is not group and not staged.runner.group.broken
    (result,) = _run(staged, [EngineRequest("again", list(prompt), params)]).values()
    assert result.outputs[0].token_ids == Reference(llama).greedy(prompt)[0]
    short = [11, 12, 13, 14, 15, 16]
    lora = EngineRequest("beta", short, SamplingParams(max_tokens=LORA_TOKENS), lora=staged.served_adapters[0])
    (result,) = _run(staged, [lora]).values()
    assert result.outputs[0].token_ids == [int(step.argmax()) for step in peft_steps(short, "beta")]


def test_a_layout_that_cannot_be_split_is_refused_in_one_line(llama: Path) -> None:
    with pytest.raises(ModelNotSupported) as refused:
        build_engine(config_of(llama, tensor_parallel_size=1, pipeline_parallel_size=3))
    message = str(refused.value)
    assert "its 2 decoder layers cannot be split into 3 pipeline stages" in message
    assert message.endswith("--pipeline-parallel-size 1, 2 would work") and "\n" not in message


def test_flags_that_do_not_go_with_it() -> None:
    assert "give 1" in (EngineConfig(pipeline_parallel_size=0).usage_problem() or "")
    both = EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2, enable_expert_parallel=True)
    assert "within one stage only" in (both.usage_problem() or "")
    assert EngineConfig(pipeline_parallel_size=2, enable_lora=True).usage_problem() is None
    assert "use mp or ray" in (EngineConfig(distributed_executor_backend="slurm").usage_problem() or "")
