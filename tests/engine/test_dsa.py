"""DSA sparse attention (DeepSeek-V3.2, GLM-5) against transformers' ``generate``: the indexer's keys cached per
token in their own pages, the top-k selection per query over the paged cache, then attention over the chosen
tokens. Tiny random models from transformers' config classes with ``index_topk = 8`` (below every prompt, so the
selection bites) and 8 indexer heads (fewer tie at ReLU zeros, and transformers then disagrees with itself); greedy
tokens identical, logprobs within 1e-4, with plain and chunked prefill, prefix-cache hits, n = 2 and preemption."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sparse_models import build
from test_architectures import NEW_TOKENS, Reference, _check, _engine, _prompts, _run

from batchgen.server.engine import EngineRequest, SamplingParams
from batchgen.server.engine.errors import ModelNotSupported

FAMILIES = ["deepseek_v32", "glm_moe_dsa"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(
    request: pytest.FixtureRequest, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, Reference]]:
    path = build(request.param, tokenizer, tmp_path_factory.mktemp(request.param))
    yield path, Reference(path)


def test_prefill_decode_and_prefix_cache(family: tuple[Path, Reference], tokenizer: Any) -> None:
    path, reference = family
    engine = _engine(path, tokenizer)
    assert engine.runner.sparse and engine.runner.cache.indexer_keys
    _check(engine, reference)


def test_chunked_prefill_small_blocks_and_n(family: tuple[Path, Reference], tokenizer: Any) -> None:
    path, reference = family
    _check(_engine(path, tokenizer, block_size=8, max_num_batched_tokens=16), reference, n=2)


def test_preemption(family: tuple[Path, Reference], tokenizer: Any) -> None:
    """Too few blocks for every prompt at once: sequences are preempted and recomputed, their indexer keys too."""
    path, reference = family
    engine = _engine(path, tokenizer, block_size=4, num_kv_blocks=20, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
    prompts = _prompts()[:4]
    results = _run(engine, [EngineRequest(str(i), list(p), params) for i, p in enumerate(prompts)])
    assert engine.stats().preemptions > 0
    for i, prompt in enumerate(prompts):
        tokens, logprobs = reference.greedy(prompt)
        output = results[str(i)].outputs[0]
        assert output.token_ids == tokens
        assert output.logprobs is not None
        worst = max(abs(lp.logprob - logprobs[j][lp.token_id].item()) for j, lp in enumerate(output.logprobs))
        assert worst < 1e-4


def test_the_selection_bites(family: tuple[Path, Reference]) -> None:
    """Without the selection (every causal token), the reference's logits differ: the tests above check it."""
    _, reference = family
    prompt = torch.tensor([_prompts()[3]])
    model = reference.model
    with torch.no_grad():
        sparse = model(prompt).logits
        indexers = [m for m in model.modules() if hasattr(m, "index_topk")]
        for indexer in indexers:
            indexer.index_topk = 10_000
        try:
            dense = model(prompt).logits
        finally:
            for indexer in indexers:
                indexer.index_topk = 8
    assert (sparse - dense).abs().max().item() > 1e-2


def test_lora_is_refused_in_one_line(family: tuple[Path, Reference], tokenizer: Any) -> None:
    """The indexer's projections run on parts of the packed row, which the LoRA slots' per-token mask does not
    follow: refused by name rather than served wrong."""
    path, _ = family
    with pytest.raises(ModelNotSupported, match="LoRA adapters on DSA sparse-attention layers are not served"):
        _engine(path, tokenizer, enable_lora=True)
