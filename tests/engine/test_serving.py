"""The OpenAI serving layer over the real engine: completions, chat, embeddings, errors and precedence."""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import torch

from batchgen.schemas import (
    BODY_TYPES,
    BatchInputLine,
    ChatCompletion,
    EmbeddingList,
    ErrorResponse,
    TextCompletion,
    parse_output_line,
)
from batchgen.server.engine import LLMEngine
from batchgen.server.serving import BatchDefaults, OpenAIServing, RequestRejected

Run = Callable[..., Any]
NO_DEFAULTS = BatchDefaults()


def _line(url: str, body: dict[str, Any], custom_id: str = "req-1") -> BatchInputLine:
    typed = msgspec.convert({"model": "demo", **body}, BODY_TYPES[url])
    return BatchInputLine(custom_id=custom_id, method="POST", url=url, body=typed)


@pytest.fixture
def serve(make_engine: Callable[..., LLMEngine], run_to_completion: Run) -> Callable[..., Any]:
    """Run one input line through OpenAIServing and a fresh engine; return the output line (re-parsed from JSON)."""

    def run(line: Any, defaults: BatchDefaults = NO_DEFAULTS, **engine_overrides: Any) -> Any:
        engine = make_engine(**engine_overrides)
        serving = OpenAIServing(engine.tokenizer, engine.model_name, engine.max_context_length)
        requests = serving.to_engine_requests(line, request_id="rid", defaults=defaults, group="batch_1")
        results = run_to_completion(engine, requests)
        in_order = [results[request.request_id] for request in requests]
        encoded = msgspec.json.encode(serving.output_line(line, in_order, request_id="rid"))
        return parse_output_line(encoded), requests

    return run


def test_completions_match_hf_greedy_with_choice_indices_and_usage(
    serve: Callable[..., Any], hf_greedy: Callable[..., list[int]], tokenizer: Any, random_prompts: Run
) -> None:
    token_prompt = random_prompts(1, 12, 12, seed=20)[0]
    line = _line("/v1/completions", {"prompt": ["Hello there", token_prompt], "max_tokens": 12, "n": 2})
    out, requests = serve(line)
    assert out.custom_id == "req-1" and out.id.startswith("batch_req_") and out.error is None
    assert out.response.status_code == 200 and out.response.request_id == "rid"
    body = out.response.body
    assert isinstance(body, TextCompletion) and body.model == "demo"
    assert [c.index for c in body.choices] == [0, 1, 2, 3]
    prompts = [tokenizer.encode("Hello there"), token_prompt]
    assert [r.prompt_token_ids for r in requests] == prompts
    for choice in body.choices:
        expected = hf_greedy(prompts[choice.index // 2], 12)
        assert choice.text == tokenizer.decode(expected, skip_special_tokens=True)
    completion = sum(2 * len(hf_greedy(p, 12)) for p in prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    assert body.usage.prompt_tokens == prompt_tokens and body.usage.completion_tokens == completion
    assert body.usage.total_tokens == prompt_tokens + completion


def test_completions_of_32_token_prompts_match_hf_generate(
    serve: Callable[..., Any], hf_greedy: Callable[..., list[int]], random_prompts: Run, tokenizer: Any
) -> None:
    prompts = random_prompts(36, 1, 90)[:32]  # the prompts of test_greedy: their references are cached
    out, _ = serve(_line("/v1/completions", {"prompt": prompts, "max_tokens": 24}), max_num_batched_tokens=64)
    body = out.response.body
    assert [c.index for c in body.choices] == list(range(32))
    for choice, prompt in zip(body.choices, prompts, strict=True):
        expected = hf_greedy(prompt, 24)
        assert choice.text == tokenizer.decode(expected, skip_special_tokens=True), choice.index
        assert choice.finish_reason == ("stop" if len(expected) < 24 else "length")
    assert body.usage.completion_tokens == sum(len(hf_greedy(p, 24)) for p in prompts)


def test_chat_uses_the_template_and_reports_cached_tokens(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, tokenizer: Any
) -> None:
    engine = make_engine()
    serving = OpenAIServing(engine.tokenizer, engine.model_name, engine.max_context_length)
    system = "You are a helpful assistant. " * 4
    bodies = []
    for i, question in enumerate(["What is 2+2?", "Name a colour."]):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        line = _line("/v1/chat/completions", {"messages": messages, "max_completion_tokens": 8}, f"c{i}")
        requests = serving.to_engine_requests(line, request_id=f"r{i}", defaults=BatchDefaults(), group="g")
        expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert requests[0].prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
        results = list(run_to_completion(engine, requests).values())
        bodies.append(serving.output_line(line, results, request_id=f"r{i}").response.body)
    assert all(isinstance(b, ChatCompletion) for b in bodies)
    assert bodies[0].usage.prompt_tokens_details.cached_tokens == 0
    assert bodies[1].usage.prompt_tokens_details.cached_tokens >= 16 * (len(system) // 16 - 1)
    assert bodies[1].choices[0].message.role == "assistant"
    assert bodies[1].usage.completion_tokens <= 8


def test_chat_logprobs_shape(serve: Callable[..., Any]) -> None:
    line = _line(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "logprobs": True, "top_logprobs": 2},
    )
    body = serve(line)[0].response.body
    content = body.choices[0].logprobs.content
    assert len(content) == body.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_completion_logprobs_shape(serve: Callable[..., Any]) -> None:
    body = serve(_line("/v1/completions", {"prompt": "abc", "max_tokens": 4, "logprobs": 3, "ignore_eos": True}))[0]
    logprobs = body.response.body.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 4
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)


def test_batch_defaults_and_precedence(serve: Callable[..., Any]) -> None:
    prompt = {"prompt": "abc", "ignore_eos": True}
    defaults = BatchDefaults(max_decoding_length=3, temperature=0.7, top_p=0.5, top_k=4, max_context_length=100)
    _, requests = serve(_line("/v1/completions", prompt), defaults)
    params = requests[0].params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (3, 0.7, 0.5, 4)
    assert params.max_context_length == 100
    line = _line("/v1/completions", {**prompt, "max_tokens": 5, "temperature": 0.0, "top_p": 1.0, "top_k": -1})
    out, requests = serve(line, defaults)
    params = requests[0].params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (5, 0.0, 1.0, 0)
    assert out.response.body.usage.completion_tokens == 5
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "max_completion_tokens": 2}
    assert serve(_line("/v1/chat/completions", chat), defaults)[1][0].params.max_tokens == 2
    _, requests = serve(_line("/v1/completions", {"prompt": "abc", "max_tokens": 2}))
    assert requests[0].params.temperature == 0.0  # unset temperature is greedy


def test_embeddings_match_a_direct_forward(serve: Callable[..., Any], hf_model: Any, tokenizer: Any) -> None:
    texts = ["The quick brown fox", "jumps over the lazy dog " * 5]
    out, _ = serve(_line("/v1/embeddings", {"input": texts}), max_num_batched_tokens=16)  # chunked prefill too
    body = out.response.body
    assert isinstance(body, EmbeddingList)
    for item, text in zip(body.data, texts, strict=True):
        ids = torch.tensor([tokenizer.encode(text)])
        with torch.no_grad():
            hidden = hf_model.model(ids).last_hidden_state[0].mean(dim=0)
        expected = torch.nn.functional.normalize(hidden, dim=0)
        assert torch.allclose(torch.tensor(item.embedding, dtype=torch.float64), expected, atol=1e-5)
    assert body.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)


def test_embedding_dimensions_and_base64(serve: Callable[..., Any]) -> None:
    full = serve(_line("/v1/embeddings", {"input": "hello"}))[0].response.body.data[0].embedding
    short = serve(_line("/v1/embeddings", {"input": "hello", "dimensions": 8}))[0].response.body.data[0].embedding
    assert len(short) == 8
    norm = sum(x * x for x in full[:8]) ** 0.5
    assert short == pytest.approx([x / norm for x in full[:8]], abs=1e-9)
    encoded = serve(_line("/v1/embeddings", {"input": "hello", "encoding_format": "base64"}))[0]
    raw = base64.b64decode(encoded.response.body.data[0].embedding)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(full, abs=1e-6)


def test_context_length_error_becomes_a_400_line(serve: Callable[..., Any]) -> None:
    out, _ = serve(_line("/v1/completions", {"prompt": "x" * 100, "max_tokens": 4}), max_model_len=50)
    assert out.response.status_code == 400 and out.error is None
    body = out.response.body
    assert isinstance(body, ErrorResponse)
    assert body.error.code == "context_length_exceeded" and body.error.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("url", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
            "response_format",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [99999]]}, "prompt"),
        ("/v1/embeddings", {"input": ""}, "input"),
    ],
)
def test_unsupported_or_invalid_requests_are_rejected(
    tokenizer: Any, url: str, body: dict[str, Any], param: str
) -> None:
    serving = OpenAIServing(tokenizer, "demo", 2048)
    with pytest.raises(RequestRejected) as caught:
        serving.to_engine_requests(_line(url, body), request_id="r", defaults=BatchDefaults(), group="g")
    assert caught.value.param == param and caught.value.message
