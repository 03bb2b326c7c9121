"""The pooling endpoints on real servers over HTTP, one per model kind: a Qwen3-Reranker-shaped decoder
(``--task score``), a BERT cross-encoder and a sentence-transformers decoder embedding model (``--runner pooling``).
Scores and vectors equal the models' own forward within 1e-5 (their libraries' wrappers are checked in
tests/engine/test_pooling_models.py);
a rerank's order is the scores' order; the same bodies run as batch lines; bad input is a 400 naming its field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pooling_helpers import build_cross_encoder, build_st_embedding, build_yes_no_reranker
from server_helpers import LiveServer, ServerProcess
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from batchgen.schemas import MAX_POOLING_INPUTS
from batchgen.server.engine.loading.pooling_spec import (
    QWEN3_RERANKER_INSTRUCTION,
    QWEN3_RERANKER_PREFIX,
    QWEN3_RERANKER_SUFFIX,
)

TOLERANCE = 1e-5
QUERY = "a big red cat"
DOCUMENTS = ["the cat sat on the mat", "a dog ran far", "big red house", "blue tree and a cat", "a"]


def _server(tmp: Path, model: Path, *flags: str) -> Iterator[LiveServer]:
    with ServerProcess(tmp, "--model", str(model), "--dtype", "float32", *flags) as process:
        server = LiveServer(process)
        yield server
        server.http.close()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Path]]:
    path = build_yes_no_reranker(tmp_path_factory.mktemp("reranker"))
    for server in _server(tmp_path_factory.mktemp("server"), path, "--task", "score", "--max-model-len", "512"):
        yield server, path


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Path]]:
    path = build_cross_encoder(tmp_path_factory.mktemp("bert"), "bert")
    for server in _server(tmp_path_factory.mktemp("server"), path):
        yield server, path


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Path]]:
    prompts = {"query": "Instruct: find it\nQuery: ", "document": ""}
    path = build_st_embedding(tmp_path_factory.mktemp("embed"), prompts=prompts)
    for server in _server(tmp_path_factory.mktemp("server"), path, "--runner", "pooling"):
        yield server, path


def _post(server: LiveServer, url: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    response = server.http.post(url, json={"model": server_model(server), **body})
    assert response.status_code == status, response.text
    return response.json()  # type: ignore[no-any-return]


def server_model(server: LiveServer) -> str:
    return str(server.http.get("/v1/models").json()["data"][0]["id"])


def _reranker_scores(path: Path, query: str, documents: list[str]) -> list[float]:
    """Qwen3-Reranker's model card, run with transformers."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prefix = tokenizer.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    scores = []
    for document in documents:
        text = f"<Instruct>: {QWEN3_RERANKER_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        ids = prefix + tokenizer.encode(text, add_special_tokens=False) + suffix
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1, [no, yes]]
        scores.append(torch.log_softmax(logits, dim=-1).exp()[1].item())
    return scores


def test_decoder_reranker_rerank_and_score(reranker: tuple[LiveServer, Path]) -> None:
    server, path = reranker
    want = _reranker_scores(path, QUERY, DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    for url in ("/v1/rerank", "/rerank", "/v2/rerank"):
        body = _post(server, url, {"query": QUERY, "documents": DOCUMENTS, "top_n": 3})
        assert [result["index"] for result in body["results"]] == order[:3]
        for result in body["results"]:
            assert abs(result["relevance_score"] - want[result["index"]]) < TOLERANCE
            assert result["document"] == {"text": DOCUMENTS[result["index"]]}
        assert body["usage"]["prompt_tokens"] > 0 and body["id"].startswith("rerank-")
    bare = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "return_documents": False})
    assert len(bare["results"]) == len(DOCUMENTS) and all(r["document"] is None for r in bare["results"])
    for sides in ({"text_1": QUERY, "text_2": DOCUMENTS}, {"queries": QUERY, "documents": DOCUMENTS}):
        scored = _post(server, "/v1/score", sides)
        assert scored["object"] == "list" and [item["index"] for item in scored["data"]] == list(range(5))
        assert max(abs(item["score"] - w) for item, w in zip(scored["data"], want, strict=True)) < TOLERANCE
    pairs = _post(server, "/score", {"text_1": [QUERY, "dog"], "text_2": DOCUMENTS[:2]})
    assert abs(pairs["data"][1]["score"] - _reranker_scores(path, "dog", DOCUMENTS[1:2])[0]) < TOLERANCE


def test_reranker_refusals(reranker: tuple[LiveServer, Path], live_server: LiveServer) -> None:
    server, _ = reranker

    def error(url: str, body: dict[str, Any], on: LiveServer = server) -> dict[str, Any]:
        return _post(on, url, body, 400)["error"]  # type: ignore[no-any-return]

    assert error("/v1/rerank", {"query": QUERY, "documents": []})["param"] == "documents"
    long = "word " * 120
    over = error("/v1/rerank", {"query": QUERY, "documents": ["a", long]})
    assert over["code"] == "context_length_exceeded" and over["param"] == "documents[1]"
    cut = _post(server, "/v1/rerank", {"query": QUERY, "documents": ["a", long], "truncate_prompt_tokens": -1})
    assert len(cut["results"]) == 2
    many = error("/v1/rerank", {"query": QUERY, "documents": ["a"] * (MAX_POOLING_INPUTS + 1)})
    assert many["code"] == "too_many_inputs" and many["param"] == "documents"
    assert error("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})["param"] == "text_2"
    assert error("/v1/embeddings", {"input": "a"})["code"] == "unsupported_endpoint"
    chat = error("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["code"] == "unsupported_endpoint"
    batch = {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    created = server.http.post("/v1/batches", json=batch)  # refused at creation, not line by line
    refused = created.json()["error"]
    assert created.status_code == 400 and refused["code"] == "unsupported_endpoint" and refused["param"] == "endpoint"
    assert "/v1/rerank" in refused["message"]
    generation = error("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}, live_server)
    assert generation["code"] == "unsupported_endpoint" and "/v1/embeddings" in generation["message"]
    # What was at fault is named: an instruction that alone takes the context, a side's own name (data_1 was "_1"),
    # a truncation the template leaves no room in (the tokenizer ignored it, so the prompt was not cut).
    instructed = error("/v1/rerank", {"query": QUERY, "documents": ["a"], "instruction": "word " * 200})
    assert (instructed["code"], instructed["param"]) == ("context_length_exceeded", "instruction")
    assert error("/v1/score", {"data_1": 5, "data_2": "a"})["param"] == "data_1"
    tight = error("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "truncate_prompt_tokens": 5})
    assert (tight["code"], tight["param"]) == ("invalid_value", "truncate_prompt_tokens")
    assert "template takes" in tight["message"]


def test_rerank_and_score_as_batch_lines(reranker: tuple[LiveServer, Path]) -> None:
    server, path = reranker
    model = server_model(server)
    outputs = {}
    for url, body in (
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}),
        ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
    ):
        line = {"custom_id": url, "method": "POST", "url": url, "body": {"model": model, **body}}
        batch = server.run([line], endpoint=url)
        assert batch["status"] == "completed", batch["errors"]
        outputs[url] = server.lines(batch["output_file_id"])[0]["response"]["body"]
    want = _reranker_scores(path, QUERY, DOCUMENTS)
    assert [r["index"] for r in outputs["/v1/rerank"]["results"]] == sorted(range(5), key=lambda i: -want[i])
    assert max(abs(item["score"] - w) for item, w in zip(outputs["/v1/score"]["data"], want, strict=True)) < TOLERANCE


def test_cross_encoder_scores_and_ranks(cross_encoder: tuple[LiveServer, Path]) -> None:
    """The model's own forward on the pair (CrossEncoder's sigmoid of it: tests/engine/test_pooling_models.py)."""
    server, path = cross_encoder
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        want = [torch.sigmoid(model(**tokenizer(QUERY, d, return_tensors="pt")).logits[0, 0]).item() for d in DOCUMENTS]
    scored = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert max(abs(item["score"] - w) for item, w in zip(scored["data"], want, strict=True)) < TOLERANCE
    ranked = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert [r["index"] for r in ranked["results"]] == sorted(range(5), key=lambda i: -want[i])
    raw = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[:1], "use_activation": False})
    assert abs(torch.sigmoid(torch.tensor(raw["data"][0]["score"])).item() - want[0]) < TOLERANCE
    classified = _post(server, "/classify", {"input": "the cat"})
    assert classified["data"][0]["num_classes"] == 1 and len(classified["data"][0]["probs"]) == 1
    for url, body in (("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}), ("/classify", {"input": "the cat"})):
        tight = _post(server, url, {**body, "truncate_prompt_tokens": 2}, 400)["error"]  # [CLS] a [SEP] b [SEP]
        assert tight["param"] == "truncate_prompt_tokens", tight


def test_decoder_embeddings_pool_the_last_token(embedder: tuple[LiveServer, Path]) -> None:
    """The model's last hidden state at the last token, normalized (SentenceTransformer's own vectors, prompts and
    Matryoshka cut: tests/engine/test_pooling_models.py)."""
    server, path = embedder
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)

    def vector(text: str) -> torch.Tensor:
        with torch.no_grad():
            hidden = model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=-1)

    plain = _post(server, "/v1/embeddings", {"input": DOCUMENTS})
    got = torch.tensor([item["embedding"] for item in plain["data"]])
    assert (got - torch.stack([vector(d) for d in DOCUMENTS])).abs().max().item() < TOLERANCE
    query = _post(server, "/v1/embeddings", {"input": [QUERY], "prompt_name": "query", "dimensions": 16})
    want = torch.nn.functional.normalize(vector(f"Instruct: find it\nQuery: {QUERY}")[:16], dim=-1)
    assert (torch.tensor(query["data"][0]["embedding"]) - want).abs().max().item() < TOLERANCE
    pooled = _post(server, "/pooling", {"input": DOCUMENTS[0]})
    assert pooled["data"][0]["object"] == "pooling"
    assert (torch.tensor(pooled["data"][0]["data"]) - got[0]).abs().max().item() < TOLERANCE
    refused = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}, 400)["error"]
    assert refused["code"] == "unsupported_endpoint"
    assert _post(server, "/v1/embeddings", {"input": "a", "prompt_name": "x"}, 400)["error"]["param"] == "prompt_name"
    wide = _post(server, "/v1/embeddings", {"input": "a", "dimensions": 100_000}, 400)["error"]
    assert wide["param"] == "dimensions" and "more than the model's embeddings have" in wide["message"]
