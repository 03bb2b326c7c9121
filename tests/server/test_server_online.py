"""The online endpoints on the real server: the official openai SDK (sync and async), whole and streamed answers, the
same validation and errors as batch lines, auth, a client that goes away, a full server, and an online call's time
to first token while a batch saturates the engine."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from server_helpers import TENANT_KEYS, LiveServer, chat_line

from batchgen.schemas import ChatCompletionRequest
from batchgen.schemas.requests import _unsupported_fields

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0)


def _texts(chunks: list[Any]) -> tuple[dict[int, str], dict[int, str]]:
    """Each choice's streamed text and finish reason, from chat or completion chunks."""
    text: defaultdict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            text[choice.index] += (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
            if choice.finish_reason is not None:
                assert choice.index not in finish, "one end per choice"
                finish[choice.index] = choice.finish_reason
    return dict(text), finish


def test_chat_completion_is_what_a_batch_line_gets(client: openai.OpenAI, live_server: LiveServer) -> None:
    answer = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=12)  # type: ignore[arg-type]
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-") and answer.model == "demo"
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].finish_reason in ("stop", "length")
    usage = answer.usage
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    batch = live_server.run([chat_line("same", MESSAGES[0]["content"], max_tokens=12)])
    (line,) = live_server.lines(batch["output_file_id"])
    assert line["response"]["body"]["choices"][0]["message"]["content"] == answer.choices[0].message.content


def test_streamed_chat_adds_up_to_the_whole_answer(client: openai.OpenAI) -> None:
    params: dict[str, Any] = {"model": "demo", "messages": MESSAGES, "max_tokens": 20, "n": 2, "temperature": 1.0}
    params |= {"seed": 11, "stop": ["e"], "logprobs": True, "top_logprobs": 2}
    whole = client.chat.completions.create(**params)
    chunks = list(client.chat.completions.create(**params, stream=True, stream_options={"include_usage": True}))
    assert [(c.choices[0].index, c.choices[0].delta.role, c.choices[0].delta.content) for c in chunks[:2]] == [
        (0, "assistant", ""),
        (1, "assistant", ""),
    ]
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert all(len(c.choices) == 1 and c.usage is None for c in chunks[:-1])
    text, finish = _texts(chunks)
    assert text == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    streamed_logprobs: defaultdict[int, list[str]] = defaultdict(list)
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            streamed_logprobs[choice.index] += [t.token for t in (choice.logprobs.content if choice.logprobs else [])]
    for choice in whole.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert streamed_logprobs[choice.index] == [t.token for t in choice.logprobs.content]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and whole.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )


def test_completions_whole_and_streamed_and_embeddings(client: openai.OpenAI) -> None:
    params: dict[str, Any] = {"model": "demo", "prompt": ["Once upon", "The sky"], "max_tokens": 10, "logprobs": 1}
    whole = client.completions.create(**params)
    assert whole.object == "text_completion" and [c.index for c in whole.choices] == [0, 1]
    chunks = list(client.completions.create(**params, stream=True))
    assert all(c.object == "text_completion" and c.usage is None for c in chunks)
    text, finish = _texts(chunks)
    assert text == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    options = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's: the usage so far in every chunk
    counted = list(client.completions.create(**params, stream=True, stream_options=options))  # type: ignore[arg-type]
    so_far = [c.usage.completion_tokens for c in counted if c.usage is not None]
    assert len(so_far) == len(counted) and so_far == sorted(so_far)
    assert whole.usage is not None and so_far[-1] == whole.usage.completion_tokens
    embeddings = client.embeddings.create(model="demo", input=["first", "second"])
    assert [e.index for e in embeddings.data] == [0, 1] and embeddings.model == "demo"
    assert all(abs(sum(x * x for x in e.embedding) - 1) < 1e-4 for e in embeddings.data)


def test_the_async_sdk_streams_concurrently(live_server: LiveServer) -> None:
    async def main() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused") as aclient:

            async def both(question: str) -> tuple[str, str]:
                messages = [{"role": "user", "content": question}]
                whole = await aclient.chat.completions.create(model="demo", messages=messages, max_tokens=16)  # type: ignore[arg-type]
                stream = await aclient.chat.completions.create(
                    model="demo",
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=16,
                    stream=True,
                )
                streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
                return whole.choices[0].message.content or "", streamed

            return await asyncio.gather(*(both(f"Question {i}?") for i in range(6)))

    for whole, streamed in asyncio.run(main()):
        assert streamed == whole


UNENFORCEABLE = {
    "type": "json_schema",
    "json_schema": {"name": "u", "schema": {"type": "array", "uniqueItems": True}, "strict": True},
}
"""A strict schema with a keyword the grammar cannot enforce."""


@pytest.mark.parametrize(
    ("extra", "status", "code", "param"),
    [
        ({"model": "gpt-4o"}, 404, "model_not_found", "model"),
        ({"temprature": 0.5}, 400, "unknown_parameter", "temprature"),
        ({"reasoning_effort": "low"}, 400, "unsupported_parameter", "reasoning_effort"),
        ({"guided_json": {"type": "object"}}, 400, "unsupported_parameter", "guided_json"),
        ({"response_format": UNENFORCEABLE}, 400, "invalid_grammar", "response_format"),
        ({"tool_choice": "required"}, 400, "invalid_request", "tool_choice"),  # no tools to call
        ({"temperature": 5}, 400, "invalid_value", "temperature"),
        ({"stream_options": {"include_usage": True}}, 400, "invalid_request", "stream_options"),
        ({"top_logprobs": 2}, 400, "invalid_request", "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x" * 3000}]}, 400, "context_length_exceeded", None),
    ],
)
def test_bad_requests_get_the_error_envelope(
    live_server: LiveServer, extra: dict[str, Any], status: int, code: str, param: str | None
) -> None:
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 2, **extra}
    answer = live_server.http.post("/v1/chat/completions", json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == (code, param) and error["message"]
    assert error["type"] == "invalid_request_error"


def test_the_sdk_raises_its_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.completions.create(model="demo", prompt="x", suffix="!")
    assert (unsupported.value.code, unsupported.value.param) == ("unsupported_parameter", "suffix")


def test_unsupported_fields_in_a_batch_get_error_lines_naming_them(live_server: LiveServer) -> None:
    names = _unsupported_fields(ChatCompletionRequest)
    lines = [chat_line(f"field-{name}", **{name: {"set": True}}) for name in names]
    lines += [chat_line("honoured", max_tokens=4, ignore_eos=True, logit_bias={str(ord("z")): 100}, min_p=0.5)]
    batch = live_server.run(lines)
    assert batch["request_counts"] == {"total": len(lines), "completed": 1, "failed": len(names)}
    errors = {line["custom_id"]: line["response"] for line in live_server.lines(batch["error_file_id"])}
    for name in names:
        response = errors[f"field-{name}"]
        assert response["status_code"] == 400
        assert (response["body"]["error"]["code"], response["body"]["error"]["param"]) == (
            "unsupported_parameter",
            name,
        )
    (honoured,) = live_server.lines(batch["output_file_id"])
    assert honoured["response"]["body"]["choices"][0]["message"]["content"] == "zzzz"


def test_a_batch_for_a_model_the_server_does_not_serve(live_server: LiveServer) -> None:
    batch = live_server.run([chat_line(f"q{i}", model="gpt-4o") for i in range(3)])
    assert batch["status"] == "completed" and batch["request_counts"]["failed"] == 3
    for line in live_server.lines(batch["error_file_id"]):
        assert line["response"]["status_code"] == 404
        assert line["response"]["body"]["error"]["code"] == "model_not_found"
        assert "does not exist: this server serves 'demo'" in line["response"]["body"]["error"]["message"]


def test_online_requests_need_a_key_like_the_rest(keyed_server: LiveServer) -> None:
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 2}
    with httpx.Client(base_url=keyed_server.base_url, timeout=30) as anonymous:
        for path, payload in (("/v1/chat/completions", body), ("/v1/embeddings", {"model": "demo", "input": "x"})):
            assert anonymous.post(path, json=payload).status_code == 401
    for key in TENANT_KEYS:
        headers = {"Authorization": f"Bearer {key}"}
        assert keyed_server.http.post("/v1/chat/completions", json=body, headers=headers).status_code == 200


# --- a client that goes away, a full server, priority over a batch --------------------------------------------------


def _engine_idle(server: LiveServer, timeout_s: float = 10) -> None:
    """Wait until the engine runs nothing and its generated-token count stands still."""
    deadline = time.monotonic() + timeout_s
    while True:
        first = server.http.get("/v1/pool/status").json()
        time.sleep(0.3)
        second = server.http.get("/v1/pool/status").json()
        if second["running_requests"] == 0 and first["generated_tokens"] == second["generated_tokens"]:
            return
        assert time.monotonic() < deadline, second


LONG = {"model": "demo", "messages": MESSAGES, "max_tokens": 1900, "ignore_eos": True}
"""Far longer than the tests wait: still generating unless it was aborted."""


def test_a_client_that_goes_away_aborts_its_request(live_server: LiveServer) -> None:
    """Streamed or not: the engine stops generating at once (the request alone would run for many seconds)."""
    _engine_idle(live_server)
    with httpx.Client(base_url=live_server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as stream:
            events = stream.iter_lines()
            assert [next(events) for _ in range(4)][2].startswith("data: ")  # the role, then generated text
        _engine_idle(live_server, timeout_s=3)
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json=LONG, timeout=1.0)
        _engine_idle(live_server, timeout_s=3)


@pytest.fixture(scope="module")
def small_server(server_factory: Callable[..., LiveServer]) -> LiveServer:
    """Four sequences running at once, and room for four online ones."""
    return server_factory("--max-num-seqs", "4", "--max-online-sequences", "4")


def _events(server: LiveServer, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A streamed request's events, parsed, as they arrive."""
    with (
        httpx.Client(base_url=server.base_url, timeout=60) as http,
        http.stream("POST", body["path"], json=body["json"]) as stream,
    ):
        assert stream.status_code == 200, stream.read()
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def test_a_full_server_answers_429_with_retry_after(small_server: LiveServer) -> None:
    holding = [
        _events(small_server, {"path": "/v1/chat/completions", "json": {**LONG, "n": 2, "stream": True}})
        for _ in range(2)
    ]
    for events in holding:
        next(events)  # admitted: each holds two sequences
    try:
        full = small_server.http.post("/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 1})
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full" and full.json()["error"]["type"] == "rate_limit_error"
        too_many = small_server.http.post("/v1/completions", json={"model": "demo", "prompt": "x", "n": 5})
        assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "too_many_sequences"
    finally:
        for events in holding:
            events.close()
    _engine_idle(small_server)
    assert (
        small_server.http.post("/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 1}).status_code
        == 200
    )


def test_concurrent_streams_past_the_capacity_are_answered_429(small_server: LiveServer) -> None:
    """Six streams at once against room for four: a stream takes its place when it is admitted, not when its first
    event goes out, so exactly two are turned away."""
    import contextlib
    import threading

    body = {**LONG, "stream": True}
    statuses: list[int] = []
    admitted = threading.Barrier(7)
    with contextlib.ExitStack() as streams:

        def open_stream() -> None:
            http = streams.enter_context(httpx.Client(base_url=small_server.base_url, timeout=60))
            response = streams.enter_context(http.stream("POST", "/v1/chat/completions", json=body))
            statuses.append(response.status_code)
            admitted.wait(30)

        threads = [threading.Thread(target=open_stream) for _ in range(6)]
        for thread in threads:
            thread.start()
        admitted.wait(30)
        for thread in threads:
            thread.join()
        assert sorted(statuses) == [200] * 4 + [429] * 2, statuses
    _engine_idle(small_server)


def _time_to_first_token(server: LiveServer) -> float:
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 4, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    for event in _events(server, {"path": "/v1/chat/completions", "json": body}):
        if event["choices"] and event["choices"][0]["delta"].get("content"):
            return time.monotonic() - start
    raise AssertionError("no content")


def test_an_online_call_does_not_wait_behind_a_saturating_batch(small_server: LiveServer) -> None:
    """The batch fills the running set and the engine's queue with requests that take many seconds each; the online
    call preempts one and has its first token within a step or two (measured: benchmarks/online_latency.py)."""
    idle = _time_to_first_token(small_server)
    lines = [chat_line(f"long-{i}", max_tokens=1500, ignore_eos=True) for i in range(40)]
    batch_id = small_server.create_batch(small_server.upload(lines)["id"])["id"]
    try:
        deadline = time.monotonic() + 60
        while (pool := small_server.http.get("/v1/pool/status").json())["running_requests"] < 4:
            assert time.monotonic() < deadline, pool
            time.sleep(0.05)
        busy = _time_to_first_token(small_server)
        assert small_server.batch(batch_id)["request_counts"]["completed"] == 0  # it did not wait for any of them
    finally:
        small_server.http.post(f"/v1/batches/{batch_id}/cancel")
    assert busy < max(2.0, 10 * idle), (idle, busy)
    assert small_server.wait(batch_id, timeout_s=30)["status"] == "cancelled"
