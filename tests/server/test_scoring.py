"""Scoring on the real server: legacy completions with ``echo`` and ``logprobs`` (what lm-evaluation-harness sends
for every multiple-choice task), ``max_tokens`` 0, vLLM's ``prompt_logprobs`` on chat and completions, online and in
a batch, against the demo model's own forward (float32, within 1e-4), prefix-cache hits included."""

from __future__ import annotations

from functools import cache
from typing import Any

import openai
import pytest
import torch
from server_helpers import LiveServer
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchgen.server.engine.loading.demo_model import demo_model_dir

TOLERANCE = 1e-4


@cache
def _model_and_tokenizer() -> tuple[Any, Any]:
    """The server's demo model (the same directory: the server builds it under the same cache dir)."""
    path = demo_model_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(path)


def _reference(prompt: list[int]) -> torch.Tensor:
    """The model's own log-softmax at each prompt position: row ``p`` scores the token at ``p + 1``."""
    model, _ = _model_and_tokenizer()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def _check_echo(logprobs: dict[str, Any], prompt: list[int], top: int) -> None:
    """An echoed choice's ``logprobs``: the prompt's tokens first, ``null`` for the first, the model's values after."""
    reference = _reference(prompt)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, len(prompt)):
        expected = reference[position - 1]
        assert logprobs["token_logprobs"][position] == pytest.approx(float(expected[prompt[position]]), abs=TOLERANCE)
        # Keyed by text: tokens that decode alike (bytes of a split character: "\ufffd") share an entry.
        top_values = expected.topk(top).values.tolist()
        values = sorted(logprobs["top_logprobs"][position].values(), reverse=True)
        assert 1 <= len(values) <= top and values[0] == pytest.approx(top_values[0], abs=TOLERANCE)
        assert all(min(abs(value - known) for known in top_values) < TOLERANCE for value in values)


def _check_prompt_logprobs(wire: list[Any], prompt: list[int], top: int) -> None:
    """vLLM's ``prompt_logprobs``: ``null``, then the prompt token's own entry (logprob, rank) and the top ones."""
    _, tokenizer = _model_and_tokenizer()
    reference = _reference(prompt)
    assert len(wire) == len(prompt) and wire[0] is None
    for position in range(1, len(prompt)):
        expected, token = reference[position - 1], prompt[position]
        entry = wire[position]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(float(expected[token]), abs=TOLERANCE)
        assert own["rank"] == int((expected > expected[token]).sum()) + 1
        assert own["decoded_token"] == tokenizer.decode([token])
        top_ids = expected.topk(top).indices.tolist()
        assert set(entry) == {str(token), *map(str, top_ids)}
        for rank, token_id in enumerate(top_ids, start=1):
            assert entry[str(token_id)]["logprob"] == pytest.approx(float(expected[token_id]), abs=TOLERANCE)
            assert token_id == token or entry[str(token_id)]["rank"] == rank


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0)


def _prompts() -> list[list[int]]:
    _, tokenizer = _model_and_tokenizer()
    texts = ["The capital of France is Paris, of course.", "Question: 2 + 2 = ? Answer: 4", "x"]
    return [tokenizer.encode(text) for text in texts]


def test_the_openai_sdk_scores_a_prompt_with_max_tokens_0(client: openai.OpenAI) -> None:
    _, tokenizer = _model_and_tokenizer()
    text = "Scoring asks for the prompt's own logprobs."
    answer = client.completions.create(model="demo", prompt=text, echo=True, logprobs=1, max_tokens=0)
    prompt = tokenizer.encode(text)
    (choice,) = answer.choices
    assert choice.text == tokenizer.decode(prompt, skip_special_tokens=True) == text
    assert choice.finish_reason == "length" and choice.logprobs is not None
    assert choice.logprobs.tokens == [tokenizer.decode([token]) for token in prompt]
    assert choice.logprobs.text_offset is not None and len(choice.logprobs.text_offset) == len(prompt)
    _check_echo(choice.logprobs.model_dump(), prompt, 1)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)


def test_echo_with_a_completion_several_prompts_and_n_online(live_server: LiveServer) -> None:
    prompts = _prompts()
    body = {"model": "demo", "prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 3, "n": 2}
    response = live_server.http.post("/v1/completions", json={**body, "temperature": 1.0, "seed": 3})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 6
    _, tokenizer = _model_and_tokenizer()
    for choice in choices:
        prompt = prompts[choice["index"] // 2]
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + 3
        assert choice["text"].startswith(tokenizer.decode(prompt, skip_special_tokens=True))
        _check_echo({key: value[: len(prompt)] for key, value in logprobs.items()}, prompt, 2)
        assert all(value is not None for value in logprobs["token_logprobs"][len(prompt) :])  # the completion's own


def test_a_cached_prefix_is_scored_exactly(live_server: LiveServer) -> None:
    """The prompt's first blocks are in the prefix cache from a plain request; scoring computes them again."""
    prompt = [token for text in _prompts()[:2] for token in text] * 2
    plain = live_server.http.post("/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 1})
    again = live_server.http.post("/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 1})
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, (plain.text, again.text)
    body = {"model": "demo", "prompt": [*prompt, 65, 66], "echo": True, "logprobs": 1, "max_tokens": 0}
    scored = live_server.http.post("/v1/completions", json=body).json()
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _check_echo(scored["choices"][0]["logprobs"], [*prompt, 65, 66], 1)


def test_prompt_logprobs_on_chat_and_completions(live_server: LiveServer) -> None:
    prompt = _prompts()[0]
    completion = live_server.http.post(
        "/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3}
    ).json()
    (choice,) = completion["choices"]
    assert choice["logprobs"] is None and len(choice["text"]) > 0
    _check_prompt_logprobs(choice["prompt_logprobs"], prompt, 3)

    messages = [{"role": "user", "content": "Score me."}]
    chat = live_server.http.post(
        "/v1/chat/completions", json={"model": "demo", "messages": messages, "max_tokens": 2, "prompt_logprobs": 0}
    ).json()
    _, tokenizer = _model_and_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_prompt = tokenizer.encode(rendered, add_special_tokens=False)  # as the server tokenizes a chat
    assert chat["usage"]["prompt_tokens"] == len(chat_prompt)
    _check_prompt_logprobs(chat["prompt_logprobs"], chat_prompt, 0)
    plain = live_server.http.post("/v1/chat/completions", json={"model": "demo", "messages": messages, "max_tokens": 2})
    assert "prompt_logprobs" not in plain.json()


def test_scoring_in_a_batch(live_server: LiveServer) -> None:
    prompts = _prompts()
    lines = [
        {
            "custom_id": f"score-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "demo", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0},
        }
        for i, prompt in enumerate(prompts)
    ]
    lines.append(
        {
            "custom_id": "prompt-logprobs",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "demo", "prompt": prompts[1], "max_tokens": 1, "prompt_logprobs": 2},
        }
    )
    batch = live_server.run(lines, endpoint="/v1/completions", completion_window="24h")
    assert batch["status"] == "completed" and batch["request_counts"]["failed"] == 0, batch
    output = {line["custom_id"]: line["response"]["body"] for line in live_server.lines(batch["output_file_id"])}
    for i, prompt in enumerate(prompts):
        (choice,) = output[f"score-{i}"]["choices"]
        assert len(choice["logprobs"]["tokens"]) == len(prompt)
        _check_echo(choice["logprobs"], prompt, 1)
    _check_prompt_logprobs(output["prompt-logprobs"]["choices"][0]["prompt_logprobs"], prompts[1], 2)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "echo": True, "stream": True}, "echo"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_scoring_requests_that_cannot_run_are_400(live_server: LiveServer, body: dict[str, Any], param: str) -> None:
    response = live_server.http.post("/v1/completions", json={"model": "demo", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert param in (error["param"] or "")


def test_scoring_past_the_bound_on_what_it_returns_is_400(live_server: LiveServer) -> None:
    """16 prompts x 2,000 tokens with top-20 prompt logprobs and top-20 echoed logprobs: 1.3 million logprobs, an
    answer of some 50 MB; refused before it runs, naming the bound. Online and as a batch line."""
    prompts = [[(7 * i + j) % 250 for j in range(2000)] for i in range(16)]
    body = {"model": "demo", "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 20, "prompt_logprobs": 20}
    response = live_server.http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("too_many_logprobs", "prompt_logprobs")
    assert "1344000 prompt logprobs" in error["message"] and "--max-prompt-logprob-entries" in error["message"]
    line = {"custom_id": "big", "method": "POST", "url": "/v1/completions", "body": body}
    batch = live_server.run([line], endpoint="/v1/completions")
    (failed,) = live_server.lines(batch["error_file_id"])
    assert failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"]["code"] == "too_many_logprobs"
