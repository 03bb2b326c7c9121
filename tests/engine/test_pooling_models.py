"""Pooling models through the engines, within 1e-5 in float32 of their own libraries: sentence-transformers'
``SentenceTransformer`` (decoder embedding models: last-token and mean pooling, chunked prefill, the prefix cache) and
``CrossEncoder`` (BERT, XLM-R, ModernBERT), transformers' forward (decoder classifiers, reward models, and a
Qwen3-Reranker-shaped causal LM scored by its "yes"/"no" logits)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from pooling_helpers import (
    build_cross_encoder,
    build_decoder_classifier,
    build_st_embedding,
    build_yes_no_reranker,
)
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from batchgen.schemas import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingList,
    EmbeddingRequest,
    ErrorResponse,
    RerankResponse,
    parse_output_line,
)
from batchgen.server.cli import main
from batchgen.server.engine import EngineConfig, EngineRequest, build_engine
from batchgen.server.engine.errors import ModelNotSupported
from batchgen.server.serving import BatchDefaults, OpenAIServing

TOLERANCE = 1e-5
TEXTS = ["the cat sat on the mat", "a", "big red house and a blue tree " * 4, "dog ran far"]


def _engine(path: Path, **overrides: Any) -> Any:
    config = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "max_num_batched_tokens": 24, **overrides}
    return build_engine(EngineConfig(model=str(path), **config))


def _pool(engine: Any, prompts: list[list[int]], run: Callable[..., Any], **fields: Any) -> list[Any]:
    requests = [EngineRequest(f"r{i}", ids, task="embed", **fields) for i, ids in enumerate(prompts)]
    results = run(engine, requests)
    assert all(results[f"r{i}"].error is None for i in range(len(prompts)))
    return [results[f"r{i}"] for i in range(len(prompts))]


def _in_order(results: dict[str, Any], requests: list[EngineRequest]) -> list[Any]:
    return [results[request.request_id] for request in requests]


def _close(got: list[list[float]], want: Any) -> None:
    assert torch.tensor(got).shape == torch.as_tensor(want).shape
    assert (torch.tensor(got) - torch.as_tensor(want).float()).abs().max().item() < TOLERANCE


@pytest.mark.parametrize(("kind", "pooling", "normalize"), [("qwen3", "lasttoken", True), ("llama", "mean", False)])
def test_decoder_embeddings_equal_sentence_transformers(
    tmp_path: Path, kind: str, pooling: str, normalize: bool, run_to_completion: Callable[..., Any]
) -> None:
    from sentence_transformers import SentenceTransformer

    path = build_st_embedding(tmp_path, kind, pooling, normalize, prompts={"query": "Q: ", "document": ""})
    st = SentenceTransformer(str(path), device="cpu")
    reference = st.encode(TEXTS, convert_to_tensor=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer.encode(text) for text in TEXTS]
    engine = _engine(path, runner="pooling")  # chunked: the long text's prefill takes several steps
    assert engine.tasks == {"embed"} and not hasattr(engine.runner.model, "lm_head")
    _close([result.embedding for result in _pool(engine, prompts, run_to_completion)], reference)
    # /v1/embeddings with a prompt (encode's prompt_name) and a Matryoshka cut (truncate_dim, normalized again).
    serving = OpenAIServing.for_engine(engine, engine.config)
    body = msgspec.convert(
        {"model": str(path), "input": TEXTS, "prompt_name": "query", "dimensions": 16}, EmbeddingRequest
    )
    prepared = serving.prepare(body, request_id="e", defaults=BatchDefaults())
    answer = serving.response_body(prepared, _in_order(run_to_completion(engine, prepared.requests), prepared.requests))
    assert isinstance(answer, EmbeddingList)
    want = st.encode(
        TEXTS, prompt_name="query", truncate_dim=16, normalize_embeddings=normalize, convert_to_tensor=True
    )
    _close([item.embedding for item in answer.data], want)
    if pooling != "lasttoken":
        return
    # A shared prefix is read from the cache for last-token pooling, and the vectors stay exact.
    shared = [prompts[2] + prompt for prompt in prompts]
    again = _pool(engine, shared, run_to_completion)
    assert sum(result.cached_tokens for result in again) >= 3 * 16
    reference = st.encode([TEXTS[2] + text for text in TEXTS], convert_to_tensor=True)
    _close([result.embedding for result in again], reference)


@pytest.mark.parametrize(
    ("kind", "labels", "task"), [("qwen3", ["neg", "neu", "pos"], "auto"), ("llama", ["r"], "reward")]
)
def test_decoder_classifiers_equal_transformers(
    tmp_path: Path, kind: str, labels: list[str], task: str, run_to_completion: Callable[..., Any]
) -> None:
    path = build_decoder_classifier(tmp_path, kind, labels)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer.encode(text) for text in TEXTS]
    with torch.no_grad():
        reference = [model(torch.tensor([ids])).logits[0] for ids in prompts]
    engine = _engine(path, task=task)
    _close([result.embedding for result in _pool(engine, prompts, run_to_completion)], torch.stack(reference))
    if task == "reward":
        return
    # /classify's answer: id2label of the best class, softmax probabilities.
    serving = OpenAIServing.for_engine(engine, engine.config)
    body = msgspec.convert({"model": str(path), "input": TEXTS}, ClassificationRequest)
    prepared = serving.prepare(body, request_id="r", defaults=BatchDefaults())
    answer = serving.response_body(prepared, _in_order(run_to_completion(engine, prepared.requests), prepared.requests))
    assert isinstance(answer, ClassificationResponse)
    for item, logits in zip(answer.data, reference, strict=True):
        assert item.label == labels[int(logits.argmax())] and item.num_classes == 3
        assert max(abs(a - b) for a, b in zip(item.probs, logits.softmax(-1).tolist(), strict=True)) < TOLERANCE


def test_yes_no_reranker_equals_its_recipe(tmp_path: Path, run_to_completion: Callable[..., Any]) -> None:
    path = build_yes_no_reranker(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer.encode(text) for text in TEXTS]
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    with torch.no_grad():  # Qwen3-Reranker's model card: softmax over (no, yes) at the last position
        logits = [model(torch.tensor([ids])).logits[0, -1, [no, yes]] for ids in prompts]
    reference = [torch.log_softmax(row, dim=-1).exp()[1].item() for row in logits]
    engine = _engine(path, task="score")
    results = _pool(engine, prompts, run_to_completion)
    scores = [1 / (1 + math.exp(-result.embedding[0])) for result in results]
    assert max(abs(a - b) for a, b in zip(scores, reference, strict=True)) < TOLERANCE


@pytest.mark.parametrize("kind", ["bert", "xlmr", "modernbert"])
def test_cross_encoders_equal_sentence_transformers(
    tmp_path: Path, kind: str, run_to_completion: Callable[..., Any]
) -> None:
    from sentence_transformers import CrossEncoder

    path = build_cross_encoder(tmp_path, kind)
    pairs = [("the cat", "sat on the mat"), ("a dog", "ran far and far"), ("red", "blue house")]
    reference = CrossEncoder(str(path), device="cpu").predict(pairs, convert_to_tensor=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    encoded = [tokenizer(query, document) for query, document in pairs]
    engine = _engine(path)
    requests = [
        EngineRequest(f"r{i}", e["input_ids"], task="embed", token_type_ids=e.get("token_type_ids"))
        for i, e in enumerate(encoded)
    ]
    results = run_to_completion(engine, requests)
    scores = [torch.sigmoid(torch.tensor(results[f"r{i}"].embedding)) for i in range(len(pairs))]
    _close([score.tolist() for score in scores], reference.unsqueeze(-1))
    if kind != "bert":
        return
    # run-batch: rerank and score lines, answered as the online endpoints answer them.
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bodies = [
        {"query": "the cat", "documents": [d for _, d in pairs]},
        {"query": "x", "documents": ["a", "the " * 200]},
    ]
    source.write_text(
        "".join(
            json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/rerank", "body": {"model": "m", **body}})
            + "\n"
            for i, body in enumerate(bodies)
        )
    )
    flags = ["--model", str(path), "--served-model-name", "m", "--device", "cpu", "--no-progress"]
    assert main(["run-batch", "-i", str(source), "-o", str(output), *flags]) == 0
    lines = {line.custom_id: line for line in map(parse_output_line, output.read_text().splitlines())}
    ranked = lines["c0"].response.body
    want = CrossEncoder(str(path), device="cpu").predict([("the cat", d) for _, d in pairs]).tolist()
    assert isinstance(ranked, RerankResponse)
    assert [r.index for r in ranked.results] == sorted(range(len(pairs)), key=lambda i: -want[i])
    assert max(abs(r.relevance_score - want[r.index]) for r in ranked.results) < TOLERANCE
    refused = lines["c1"].response.body
    assert isinstance(refused, ErrorResponse) and refused.error.param == "documents[1]"


def test_refusals_name_the_task(tmp_path: Path) -> None:
    path = build_yes_no_reranker(tmp_path)
    with pytest.raises(ModelNotSupported, match="--task classify needs a \\*ForSequenceClassification"):
        _engine(path, task="classify")
