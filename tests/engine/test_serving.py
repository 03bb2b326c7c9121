"""The OpenAI serving layer over the real engine: completions, chat, embeddings, errors and precedence."""

from __future__ import annotations

import base64
import copy
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
    Response,
    TextCompletion,
    parse_output_line,
)
from batchgen.schemas.requests import _unsupported_fields
from batchgen.server.engine import LLMEngine
from batchgen.server.engine.request import vocabulary_problem
from batchgen.server.serving import BatchDefaults, OpenAIServing, RequestRejected, preparing
from batchgen.server.serving.response_stream import ResponseStream

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
        serving = OpenAIServing(engine.tokenizer, ("demo",), engine.max_context_length, engine.vocab_size)
        prepared = serving.prepare(line.body, request_id="rid", defaults=defaults)
        requests = prepared.requests
        results = run_to_completion(engine, requests)
        in_order = [results[request.request_id] for request in requests]
        encoded = msgspec.json.encode(serving.output_line(line.custom_id, prepared, in_order))
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
    serving = OpenAIServing(engine.tokenizer, ("demo",), engine.max_context_length, engine.vocab_size)
    system = "You are a helpful assistant. " * 4
    bodies = []
    for i, question in enumerate(["What is 2+2?", "Name a colour."]):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        line = _line("/v1/chat/completions", {"messages": messages, "max_completion_tokens": 8}, f"c{i}")
        prepared = serving.prepare(line.body, request_id=f"r{i}", defaults=BatchDefaults())
        requests = prepared.requests
        expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert requests[0].prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
        results = list(run_to_completion(engine, requests).values())
        bodies.append(serving.output_line(line.custom_id, prepared, results).response.body)
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
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}, "strict": True},
                },
            },
            "response_format",
        ),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [99999]]}, "prompt"),
        ("/v1/embeddings", {"input": ""}, "input"),
    ],
)
def test_unsupported_or_invalid_requests_are_rejected(
    tokenizer: Any, url: str, body: dict[str, Any], param: str
) -> None:
    serving = OpenAIServing(tokenizer, ("demo",), 2048, len(tokenizer))
    with pytest.raises(RequestRejected) as caught:
        serving.prepare(_line(url, body).body, request_id="r", defaults=BatchDefaults())
    assert caught.value.param == param and caught.value.message


# --- nothing silent: every field honoured, a no-op, or refused by name -----------------------------------------------

CHAT_BODY = {"messages": [{"role": "user", "content": "x"}]}
PROMPTS = {
    "/v1/chat/completions": CHAT_BODY,
    "/v1/completions": {"prompt": "x"},
    "/v1/embeddings": {"input": "x"},
    "/v1/responses": {"input": "x"},
    **{key: {"text_1": "x", "text_2": "y"} for key in ["/v1/score", "/score"]},
    **{key: {"query": "x", "documents": ["y"]} for key in ["/v1/rerank", "/rerank", "/v2/rerank"]},
    "/classify": {"input": "x"},
    "/pooling": {"input": "x"},
}
GENERATION_URLS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]


def _refused(serving: OpenAIServing, url: str, body: dict[str, Any]) -> RequestRejected:
    with pytest.raises(RequestRejected) as caught:
        serving.prepare(_line(url, {**PROMPTS[url], **body}).body, **ARGS)
    return caught.value


ARGS: dict[str, Any] = {"request_id": "r", "defaults": BatchDefaults()}
UNSUPPORTED = [
    (url, name) for url, body_type in BODY_TYPES.items() for name in _unsupported_fields(body_type)
]  # fmt: skip


@pytest.mark.parametrize(("url", "name"), UNSUPPORTED, ids=[f"{url[4:]}-{name}" for url, name in UNSUPPORTED])
def test_each_unsupported_field_is_refused_by_name(tokenizer: Any, url: str, name: str) -> None:
    error = _refused(OpenAIServing(tokenizer, ("demo",), 2048, len(tokenizer)), url, {name: {"any": "value"}})
    assert (error.code, error.param, error.status_code) == ("unsupported_parameter", name, 400)
    assert f"'{name}' is not supported" in error.message


@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/v1/chat/completions", {"modalities": ["text"], "echo": False, "best_of": 1, "use_beam_search": False}),
        ("/v1/chat/completions", {"user": "u", "store": True, "metadata": {"k": "v"}, "service_tier": "auto"}),
        ("/v1/chat/completions", {"prompt_cache_key": "k", "safety_identifier": "s", "parallel_tool_calls": True}),
        ("/v1/completions", {"best_of": 2, "n": 2, "suffix": "", "include_stop_str_in_output": False}),
        ("/v1/embeddings", {"normalize": True, "user": "u", "truncate_prompt_tokens": None}),
    ],
)
def test_no_op_values_are_accepted(tokenizer: Any, url: str, body: dict[str, Any]) -> None:
    serving = OpenAIServing(tokenizer, ("demo",), 2048, len(tokenizer))
    assert serving.prepare(_line(url, {**PROMPTS[url], **body}).body, **ARGS).requests


def test_a_model_it_does_not_serve_is_not_found(tokenizer: Any) -> None:
    serving = OpenAIServing(tokenizer, ("demo", "alias"), 2048, len(tokenizer))
    for url in GENERATION_URLS:
        error = _refused(serving, url, {"model": "gpt-4o"})
        assert (error.code, error.param, error.status_code) == ("model_not_found", "model", 404)
        assert error.message == "The model 'gpt-4o' does not exist: this server serves 'demo' or 'alias'."
        assert serving.prepare(_line(url, {**PROMPTS[url], "model": "alias"}).body, **ARGS).requests


def test_a_response_request_is_translated_once_for_its_answer_whole_or_streamed(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A response request runs as its chat request: translated when it is prepared, its answer (whole, or as a
    stream's events) made from what the preparation kept."""
    translated = []
    translate = preparing.translate
    monkeypatch.setattr(preparing, "translate", lambda body: translated.append(body) or translate(body))
    engine = make_engine()
    serving = OpenAIServing(engine.tokenizer, ("demo",), engine.max_context_length, engine.vocab_size)
    for stream in (False, True):
        body = _line("/v1/responses", {"input": "hi", "max_output_tokens": 4, "stream": stream}).body
        prepared = serving.prepare(body, **ARGS, online=True)
        (result,) = run_to_completion(engine, prepared.requests).values()
        if stream:
            events = ResponseStream(prepared, serving.logprobs)
            sent = [*events.start(), *events.add(0, result), *events.end()]
            assert sent[-1].startswith((b"event: response.completed", b"event: response.incomplete"))
        else:
            assert isinstance(serving.response_body(prepared, [result]), Response)
    assert len(translated) == 2


def test_the_sampling_extensions_reach_the_engine(tokenizer: Any) -> None:
    serving = OpenAIServing(tokenizer, ("demo",), 2048, len(tokenizer))
    body = {
        "prompt": "x",
        "min_p": 0.1,
        "min_tokens": 3,
        "repetition_penalty": 1.2,
        "logit_bias": {"65": 5, "66": -100},
        "stop_token_ids": [10, 11],
        "skip_special_tokens": False,
        "add_special_tokens": False,
        "seed": 9,
    }
    (request,) = serving.prepare(_line("/v1/completions", body).body, **ARGS).requests
    params = request.params
    assert (params.min_p, params.min_tokens, params.repetition_penalty, params.seed) == (0.1, 3, 1.2, 9)
    assert (params.logit_bias, params.stop_token_ids, params.skip_special_tokens) == (
        {65: 5, 66: -100},
        (10, 11),
        False,
    )
    assert request.prompt_token_ids == tokenizer.encode("x", add_special_tokens=False)
    for param, value in (("logit_bias", {"4096": 1}), ("stop_token_ids", [4096])):
        error = _refused(serving, "/v1/completions", {param: value})
        assert (error.code, error.param) == ("invalid_value", param)
        assert error.message == f"'{param}' has token ids outside the model's vocabulary (0-258): [4096]."
    error = _refused(serving, "/v1/completions", {"min_tokens": 9, "max_tokens": 4})
    assert (error.code, error.param) == ("invalid_value", "min_tokens")
    line = _line("/v1/chat/completions", {**CHAT_BODY, "response_format": {"type": "json_object"}})
    (request,) = serving.prepare(line.body, **ARGS).requests
    assert request.params.grammar is not None and '"type":"object"' in request.params.grammar


def test_token_ids_are_the_models_not_the_tokenizers(tokenizer: Any) -> None:
    """A token id a request may name is one the model has (a row of its embedding, which may have more rows than the
    tokenizer has entries): prompts, stop_token_ids and logit_bias alike, refused as the engine's admission words it,
    naming the request's own field."""
    beyond = len(tokenizer) + 10
    named = {"prompt": [beyond], "stop_token_ids": [beyond], "logit_bias": {str(beyond): 1}}
    padded = OpenAIServing(tokenizer, ("demo",), 2048, len(tokenizer) + 64)
    for param, value in named.items():
        assert padded.prepare(_line("/v1/completions", {"prompt": "x", param: value}).body, **ARGS).requests
    small = OpenAIServing(tokenizer, ("demo",), 2048, beyond)
    for param in named:
        error = _refused(small, "/v1/completions", {param: named[param]})
        assert (error.code, error.param) == ("invalid_value", param)
        assert error.message == vocabulary_problem(param, [beyond], beyond)
    error = _refused(small, "/v1/embeddings", {"input": [[1, beyond]]})
    assert (error.param, error.message) == ("input", vocabulary_problem("input", [beyond], beyond))
    error = _refused(small, "/v1/responses", {"stop_token_ids": [beyond]})
    assert (error.code, error.param) == ("invalid_value", "stop_token_ids")


def test_the_model_generation_config_sits_beneath_batch_and_request(tokenizer: Any) -> None:
    model = {"temperature": 0.6, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 7}
    serving = OpenAIServing(tokenizer, ("demo",), 2048, len(tokenizer), generation_defaults=model)

    def params(body: dict[str, Any], defaults: BatchDefaults = NO_DEFAULTS) -> Any:
        line = _line("/v1/completions", {"prompt": "x", **body})
        return serving.prepare(line.body, request_id="r", defaults=defaults).requests[0].params

    fields = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
    assert tuple(getattr(params({}), f) for f in fields) == (0.6, 0.8, 20, 0.05, 1.1, 7)
    batch = BatchDefaults(temperature=0.3, top_p=0.5, top_k=4, max_decoding_length=3)
    assert tuple(getattr(params({}, batch), f) for f in fields) == (0.3, 0.5, 4, 0.05, 1.1, 3)
    request = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 9}
    assert tuple(getattr(params(request, batch), f) for f in fields) == (0.0, 1.0, 0, 0.0, 1.0, 9)


# --- chat templates: tools, template variables, the generation prompt -------------------------------------------------

TOOLS_TEMPLATE = (
    "{% if tools %}[tools:{% for tool in tools %}{{ tool.function.name }};{% endfor %}]{% endif %}"
    "{% if think %}[think]{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for call in m.tool_calls or [] %}{{ call.function.name }}({{ call.function.arguments.city }}){% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


@pytest.fixture
def tools_serving(tokenizer: Any) -> OpenAIServing:
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = TOOLS_TEMPLATE
    return OpenAIServing(templated, ("demo",), 2048, len(templated))


def _prompt(serving: OpenAIServing, body: dict[str, Any]) -> str:
    (request,) = serving.prepare(_line("/v1/chat/completions", {**CHAT_BODY, **body}).body, **ARGS).requests
    return str(serving.preparer.tokenizer.decode(request.prompt_token_ids))


def test_tools_and_template_variables_are_rendered(tools_serving: OpenAIServing) -> None:
    assert _prompt(tools_serving, {"tools": [WEATHER]}) == "[tools:weather;]<user>x<assistant>"
    assert _prompt(tools_serving, {"tools": [WEATHER], "tool_choice": "none"}) == "<user>x<assistant>"
    assert _prompt(tools_serving, {"chat_template_kwargs": {"think": True}}) == "[think]<user>x<assistant>"
    assert _prompt(tools_serving, {"add_generation_prompt": False}) == "<user>x"
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    history.append({"role": "tool", "content": "-3 C", "tool_call_id": "c1"})
    rendered = _prompt(tools_serving, {"messages": history})
    assert rendered == "<user>x<assistant>weather(Oslo)<tool>-3 C<assistant>"  # arguments as an object


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"chat_template_kwargs": {"enable_thinking": False}}, "", "chat_template_kwargs.enable_thinking"),
        ({"chat_template_kwargs": {"e": 1}}, "", "chat_template_kwargs.e"),  # in the source's text, not a variable
        ({"chat_template_kwargs": {"tokenize": True}}, "invalid_value", "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "invalid_value", "chat_template_kwargs"),
    ],
)
def test_what_the_template_would_drop_is_refused(
    tools_serving: OpenAIServing, body: dict[str, Any], code: str, param: str
) -> None:
    error = _refused(tools_serving, "/v1/chat/completions", body)
    assert (error.code, error.param) == (code or "unsupported_parameter", param)


def test_tool_calls_and_results_a_template_would_drop_are_refused(tokenizer: Any) -> None:
    """The demo template renders roles and contents only: a conversation's tool calls would be lost; a template that
    skips the 'tool' role would lose tool results."""
    serving = OpenAIServing(tokenizer, ("demo",), 2048, len(tokenizer))
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    with_call = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    error = _refused(serving, "/v1/chat/completions", {"messages": with_call})
    assert (error.code, error.param) == ("unsupported_parameter", "messages[1].tool_calls")
    chatty = copy.deepcopy(tokenizer)
    chatty.chat_template = (
        "{% for m in messages if m.role in ['user', 'assistant'] %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    with_result = [*with_call[:1], {"role": "tool", "content": "-3 C", "tool_call_id": "c1"}]
    error = _refused(
        OpenAIServing(chatty, ("demo",), 2048, len(chatty)), "/v1/chat/completions", {"messages": with_result}
    )
    assert (error.code, error.param) == ("unsupported_parameter", "messages[1].role")
    assert serving.prepare(_line("/v1/chat/completions", {"messages": with_result}).body, **ARGS).requests


@pytest.mark.parametrize("url", GENERATION_URLS)
def test_a_text_too_long_for_the_context_is_refused_before_it_is_tokenized(tokenizer: Any, url: str) -> None:
    encoded = 0

    class Counting(type(tokenizer)):  # type: ignore[misc]
        def encode(self, *args: Any, **kwargs: Any) -> Any:
            nonlocal encoded
            encoded += 1
            return super().encode(*args, **kwargs)

    counting = copy.deepcopy(tokenizer)
    counting.__class__ = Counting
    serving = OpenAIServing(counting, ("demo",), 64, len(tokenizer))
    max_prompt_chars = serving.preparer.prompts.max_prompt_chars
    assert max_prompt_chars == 64 * max(map(len, tokenizer.get_vocab()))
    text = "y" * (max_prompt_chars + 1)
    body = (
        {"messages": [{"role": "user", "content": text}]}
        if "chat" in url
        else {"prompt" if "/c" in url else "input": text}
    )
    error = _refused(serving, url, body)
    assert error.code == "context_length_exceeded"
    assert "characters: more than the model's context of 64 tokens can hold" in error.message
    assert encoded == 0


def test_tools_for_a_template_without_them_are_refused(tokenizer: Any) -> None:
    error = _refused(
        OpenAIServing(tokenizer, ("demo",), 2048, len(tokenizer)), "/v1/chat/completions", {"tools": [WEATHER]}
    )
    assert (error.code, error.param) == ("unsupported_parameter", "tools")
    assert error.message == "the model's chat template does not render tools"
