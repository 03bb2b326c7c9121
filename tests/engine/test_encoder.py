"""Encoder-only models (BERT, RoBERTa): embeddings through the real loading path, vs a direct ``AutoModel`` forward."""

from __future__ import annotations

import base64
import json
import random
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel, BertTokenizer, RobertaConfig, RobertaModel

from batchgen.schemas import BatchInputLine, EmbeddingList, ErrorResponse, parse_output_line
from batchgen.schemas.validation import BODY_TYPES
from batchgen.server.cli import main
from batchgen.server.engine import EncoderEngine, EngineConfig, EngineRequest, EngineResult, EngineWorker, build_engine
from batchgen.server.serving import BatchDefaults, OpenAIServing, RequestRejected

SPECIAL = ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] is 1, as RoBERTa's position numbering expects
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "far", "and", "big", "red", "blue", "house", "tree"]
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
VOCAB = SPECIAL + WORDS + LETTERS + [f"##{c}" for c in LETTERS]
MAX_TOKENS = 64


def _build(path: Path, kind: str) -> Path:
    """A tiny random encoder and a WordPiece tokenizer, saved with save_pretrained (no hub download)."""
    torch.manual_seed(0)
    common = {
        "vocab_size": len(VOCAB),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "pad_token_id": 1,
    }
    model: BertModel | RobertaModel
    if kind == "bert":
        model = BertModel(BertConfig(max_position_embeddings=MAX_TOKENS, **common))
    else:  # positions start after the padding index: 2 more position embeddings for the same context
        model = RobertaModel(RobertaConfig(max_position_embeddings=MAX_TOKENS + 2, **common))
    model.save_pretrained(path)
    BertTokenizer(vocab={token: i for i, token in enumerate(VOCAB)}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def encoder_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {kind: _build(tmp_path_factory.mktemp(kind), kind) for kind in ("bert", "roberta")}


def _texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice([*WORDS, "zebra", "quilt"]) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def _engine(path: Path, **overrides: Any) -> EncoderEngine:
    engine = build_engine(EngineConfig(model=str(path), device="cpu", **overrides))
    assert isinstance(engine, EncoderEngine)
    return engine


def _reference(path: Path) -> Callable[[list[int]], torch.Tensor]:
    """Mean-pooled, normalized last hidden state of one input alone (no padding), from transformers directly."""
    model = AutoModel.from_pretrained(path).eval()

    def embed(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden.mean(dim=0), dim=0)

    return embed


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_embeddings_match_a_direct_forward(encoder_paths: dict[str, Path], kind: str) -> None:
    path = encoder_paths[kind]
    engine = _engine(path, max_num_seqs=8, max_num_batched_tokens=160)
    assert engine.max_context_length == MAX_TOKENS
    assert engine.tasks == {"embed"}
    prompts = [engine.tokenizer.encode(text) for text in _texts(24)]
    assert len({len(p) for p in prompts}) > 10
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, task="embed"))
    results: dict[str, EngineResult] = {}
    steps = 0
    while engine.has_unfinished_requests():
        oldest = next(f"r{i}" for i in range(len(prompts)) if f"r{i}" not in results)
        results.update((r.request_id, r) for r in engine.step())
        assert oldest in results  # the oldest waiting request is always in the next batch
        steps += 1
    assert steps >= 4  # several padded batches of mixed lengths under the token budget
    reference = _reference(path)
    for i, prompt in enumerate(prompts):
        result = results[f"r{i}"]
        assert result.error is None and result.embedding is not None and result.prompt_tokens == len(prompt)
        expected = reference(prompt)
        assert torch.allclose(torch.tensor(result.embedding), expected, atol=1e-5, rtol=0), i
    assert engine.stats().prompt_tokens == sum(map(len, prompts))


def test_errors_and_aborts(encoder_paths: dict[str, Path]) -> None:
    engine = _engine(encoder_paths["bert"])
    engine.add_request(EngineRequest("long", [5] * (MAX_TOKENS + 1), task="embed"))
    engine.add_request(EngineRequest("generate", [5, 6, 7]))
    engine.add_request(EngineRequest("empty", [], task="embed"))
    engine.add_request(EngineRequest("unknown-token", [2, engine.vocab_size, 3], task="embed"))
    for i in range(6):
        engine.add_request(EngineRequest(f"{'a' if i % 2 else 'b'}{i}", [2, 5 + i, 3], task="embed"))
    assert all(engine.abort_request(request_id) for request_id in ("a1", "a3", "a5"))
    assert engine.abort_request("b4") and not engine.abort_request("b4")
    results = {}
    while engine.has_unfinished_requests():
        results.update((r.request_id, r) for r in engine.step())
    assert sorted(results) == ["b0", "b2", "empty", "generate", "long", "unknown-token"]
    errors = {rid: r.error.code for rid, r in results.items() if r.error is not None}
    assert errors == {
        "long": "context_length_exceeded",
        "generate": "unsupported_endpoint",
        "empty": "invalid_prompt",
        "unknown-token": "invalid_prompt",
    }


def test_serving_rejects_generation_on_an_embedding_model(encoder_paths: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(encoder_paths["bert"])
    serving = OpenAIServing(tokenizer, ("tiny-bert",), MAX_TOKENS, len(VOCAB), EncoderEngine.tasks)
    for url, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "the cat"}),
    ]:
        typed = msgspec.convert({"model": "tiny-bert", **body}, BODY_TYPES[url])
        line = BatchInputLine(custom_id="x", method="POST", url=url, body=typed)
        with pytest.raises(RequestRejected) as caught:
            serving.prepare(line.body, request_id="req", defaults=BatchDefaults())
        assert caught.value.code == "unsupported_endpoint"
        assert "'tiny-bert' is an embedding model" in caught.value.message and url in caught.value.message


def _write_lines(path: Path, url: str, bodies: list[dict[str, Any]]) -> None:
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": url, "body": {"model": "tiny-bert", **body}}
        for i, body in enumerate(bodies)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_run_batch_end_to_end(encoder_paths: dict[str, Path], tmp_path: Path) -> None:
    path = encoder_paths["bert"]
    flags = ["--model", str(path), "--served-model-name", "tiny-bert", "--device", "cpu", "--no-progress"]
    flags += ["--max-num-batched-tokens", "128"]
    texts = _texts(18, seed=1)
    bodies: list[dict[str, Any]] = [{"input": texts[i : i + 3]} for i in range(0, 12, 3)]
    bodies += [
        {"input": texts[12], "dimensions": 8},
        {"input": texts[13:15], "encoding_format": "base64"},
        {"input": "zebra " * MAX_TOKENS},  # over the context
    ]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_lines(source, "/v1/embeddings", bodies)
    assert main(["run-batch", "-i", str(source), "-o", str(output), *flags]) == 0
    lines = {line.custom_id: line for line in map(parse_output_line, output.read_text().splitlines())}
    assert sorted(lines) == [f"c{i}" for i in range(len(bodies))]

    reference = _reference(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for i in range(4):
        body = lines[f"c{i}"].response.body
        assert isinstance(body, EmbeddingList)
        assert body.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts[3 * i : 3 * i + 3])
        for item, text in zip(body.data, texts[3 * i : 3 * i + 3], strict=True):
            assert torch.allclose(torch.tensor(item.embedding), reference(tokenizer.encode(text)), atol=1e-5, rtol=0)
    short = lines["c4"].response.body
    assert isinstance(short, EmbeddingList) and isinstance(short.data[0].embedding, list)
    vector = torch.tensor(short.data[0].embedding)
    assert vector.shape == (8,) and abs(vector.norm().item() - 1) < 1e-6
    encoded = lines["c5"].response.body
    assert isinstance(encoded, EmbeddingList) and isinstance(encoded.data[1].embedding, str)
    decoded = torch.tensor(struct.unpack("<32f", base64.b64decode(encoded.data[1].embedding)))
    assert torch.allclose(decoded, reference(tokenizer.encode(texts[14])), atol=1e-5, rtol=0)
    too_long = lines["c6"].response
    assert too_long.status_code == 400 and isinstance(too_long.body, ErrorResponse)
    assert too_long.body.error.code == "context_length_exceeded"

    chat = tmp_path / "chat.jsonl"
    _write_lines(chat, "/v1/chat/completions", [{"messages": [{"role": "user", "content": "hi"}]}] * 2)
    assert main(["run-batch", "-i", str(chat), "-o", str(output), *flags]) == 0
    for line in map(parse_output_line, output.read_text().splitlines()):
        assert line.response.status_code == 400 and isinstance(line.response.body, ErrorResponse)
        assert line.response.body.error.code == "unsupported_endpoint"
        assert "is an embedding model" in line.response.body.error.message


POISON = 7  # a token id ("sat") that makes the injected forward fail


def _poisoned(engine: EncoderEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's forward raises for any batch holding ``POISON``, as a device fault on one input would."""
    forward = engine.model.forward

    def failing(input_ids: torch.Tensor, **kwargs: Any) -> Any:
        if (input_ids == POISON).any():
            raise RuntimeError("injected fault")
        return forward(input_ids=input_ids, **kwargs)

    monkeypatch.setattr(engine.model, "forward", failing)


def test_a_failing_input_fails_alone(encoder_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose forward raises runs again in halves: only the request that breaks it fails, the others get the
    embeddings they get alone."""
    engine = _engine(encoder_paths["bert"], max_num_seqs=8)
    _poisoned(engine, monkeypatch)
    prompts = {f"r{i}": [2, 10 + i, 3] for i in range(7)} | {"bad": [2, POISON, 3]}
    for request_id, prompt in prompts.items():
        engine.add_request(EngineRequest(request_id, prompt, task="embed"))
    results = {r.request_id: r for r in engine.step()}
    assert not engine.has_unfinished_requests()
    error = results.pop("bad").error
    assert error is not None and error.code == "server_error" and "injected fault" in error.message
    reference = _reference(encoder_paths["bert"])
    for request_id, result in results.items():
        assert result.error is None and result.embedding is not None
        expected = reference(prompts[request_id])
        assert torch.allclose(torch.tensor(result.embedding), expected, atol=1e-5)


def test_a_worker_whose_encoder_step_fails_restarts_and_answers_everyone(
    encoder_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault outside the isolation (the step itself raises) restarts the engine in the worker: every request is
    answered, the one that keeps failing quarantined, and online callers never wait on a worker stuck restarting."""
    engine = _engine(encoder_paths["bert"], max_num_seqs=4)
    run = engine._run

    def failing(batch: list[EngineRequest], finished: list[EngineResult]) -> None:
        if any(POISON in request.prompt_token_ids for request in batch):
            raise RuntimeError("injected fault outside the isolation")
        run(batch, finished)

    monkeypatch.setattr(engine, "_run", failing)
    worker = EngineWorker(engine)
    answered: dict[str, EngineResult] = {}
    done = threading.Event()
    prompts = {f"r{i}": [2, 10 + i, 3] for i in range(6)} | {"bad": [2, POISON, 3]}

    def take(result: EngineResult) -> None:
        answered[result.request_id] = result
        if len(answered) == len(prompts):
            done.set()

    worker.start()
    try:
        worker.submit([EngineRequest(rid, prompt, task="embed") for rid, prompt in prompts.items()], take)
        assert done.wait(30), (worker.state, worker.error, sorted(answered))
    finally:
        worker.stop(timeout=10)
    assert worker.state == "running" and worker.restarts == 2  # struck once, then quarantined alone on probation
    bad = answered.pop("bad").error
    assert bad is not None and bad.code == "server_error" and "each of the two times" in bad.message
    assert all(result.error is None and result.embedding is not None for result in answered.values())
