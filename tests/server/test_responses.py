"""The Responses API through a real server with the ``openai`` SDK unchanged: ``responses.create`` (a string and
items), ``.parse(text_format=...)``, the stream's events in OpenAI's order, a ``/v1/responses`` batch, and background
responses: stored before they are answered, run exactly once across a kill -9, cancelled, and private to their
tenant."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from server_helpers import TENANT_KEYS, LiveServer, ServerProcess


class Person(BaseModel):
    name: Annotated[str, Field(max_length=8)]
    age: Annotated[int, Field(ge=0, le=120)]


def _client(server: LiveServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return _client(live_server)


def test_a_string_and_items_give_the_chat_answer(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="demo", input="Hello there", instructions="Be brief.", max_output_tokens=8, metadata={"run": "1"}
    )
    chat = client.chat.completions.create(
        model="demo",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        max_tokens=8,
    )
    assert response.id.startswith("resp_") and response.object == "response" and response.metadata == {"run": "1"}
    assert response.status == "incomplete" and response.incomplete_details is not None  # max_output_tokens cut it
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == chat.choices[0].message.content  # greedy: the chat it runs as
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, 8)

    items = client.responses.create(
        model="demo",
        input=[
            {"role": "system", "content": "Be brief."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Hello "}, {"type": "input_text", "text": "there"}],
            },
        ],
        max_output_tokens=8,
    )
    assert items.output_text == response.output_text


def test_parse_gives_a_valid_object_streamed_or_not(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model="demo", input="Describe someone.", text_format=Person, max_output_tokens=400)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    with client.responses.stream(
        model="demo", input="Describe someone.", text_format=Person, max_output_tokens=400
    ) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed


def test_the_stream_says_it_in_openai_order(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="demo", input="Tell me more.", max_output_tokens=16)
    events = list(client.responses.create(model="demo", input="Tell me more.", max_output_tokens=16, stream=True))
    kinds = [event.type for event in events]
    deltas = [i for i, kind in enumerate(kinds) if kind == "response.output_text.delta"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert deltas == list(range(4, 4 + len(deltas))) and deltas
    assert kinds[deltas[-1] + 1 :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(events[i].delta for i in deltas)  # type: ignore[union-attr]
    last = events[-1].response  # type: ignore[union-attr]
    assert text == events[deltas[-1] + 1].text == last.output_text == whole.output_text  # type: ignore[union-attr]
    assert last.usage is not None and last.usage.output_tokens == 16


def test_bad_requests_are_refused_naming_their_field(client: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"previous_response_id": "resp_x"}, "previous_response_id"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
        ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0]"),
    ]
    for fields, param in cases:
        body = {"model": "demo", "input": "x", **fields}
        with pytest.raises(openai.BadRequestError) as caught:
            client.post("/responses", body=body, cast_to=httpx.Response)
        assert caught.value.body["param"] == param, (fields, caught.value.body)  # type: ignore[index]


def test_a_responses_batch_is_answered_line_for_line(live_server: LiveServer) -> None:
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
         "body": {"model": "demo", "input": f"Line {i}", "max_output_tokens": 6}}
        for i in range(4)
    ]  # fmt: skip
    lines.append({**lines[0], "custom_id": "bad", "body": {"model": "demo", "input": "x", "tools": [{"type": "x"}]}})
    batch = live_server.run(lines, endpoint="/v1/responses")
    assert batch["status"] == "failed" and batch["errors"]["data"][0]["param"] == "body.tools[0].type"
    batch = live_server.run(lines[:4], endpoint="/v1/responses")
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 4
    answers = {line["custom_id"]: line["response"]["body"] for line in live_server.lines(batch["output_file_id"])}
    assert sorted(answers) == ["r0", "r1", "r2", "r3"]
    for body in answers.values():
        assert body["object"] == "response" and body["status"] == "incomplete"
        assert body["output"][0]["type"] == "message" and body["usage"]["output_tokens"] == 6
    assert batch["usage"]["output_tokens"] == 24


def test_a_background_response_survives_a_kill_and_runs_once(tmp_path: Path, client: openai.OpenAI) -> None:
    request: dict[str, Any] = {"model": "demo", "input": "Keep going.", "max_output_tokens": 40}
    expected = client.responses.create(**request).output_text
    process = ServerProcess(tmp_path).start()
    try:
        first = openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="unused", max_retries=0)
        queued = first.responses.create(**request, background=True)
        assert queued.status == "queued" and queued.background and queued.output == []
        assert process.process is not None
        os.kill(process.process.pid, signal.SIGKILL)  # the moment it is accepted: stored, not yet run
        process.process.wait(10)
    finally:
        process.stop()
    with ServerProcess(tmp_path) as restarted:
        second = openai.OpenAI(base_url=f"{restarted.base_url}/v1", api_key="unused", max_retries=0)
        response = _finished(second, queued.id)
        assert response.status == "incomplete" and response.id == queued.id and response.background
        assert response.output_text == expected
        files = second.files.list().data
        assert files == []  # a background response's files are not the tenant's files
        assert second.batches.list().data == []
        # Exactly once: one answer stored, however often it is read.
        http = httpx.Client(base_url=restarted.base_url)
        stored = [path for path in (tmp_path / "blobs").iterdir() if path.is_file() and path.stat().st_size]
        answers = [path for path in stored if b'"object":"response"' in path.read_bytes()]
        assert len(answers) == 1 and answers[0].read_bytes().count(b"\n") == 1
        assert http.get(f"/v1/responses/{queued.id}").json()["output"][0]["content"][0]["text"] == expected
        http.close()


def test_cancel_and_another_tenants_404(keyed_server: LiveServer) -> None:
    owner, other = _client(keyed_server, TENANT_KEYS[0]), _client(keyed_server, TENANT_KEYS[1])
    created = owner.responses.create(model="demo", input="A long one.", max_output_tokens=1500, background=True)
    for call in (other.responses.retrieve, other.responses.cancel):
        with pytest.raises(openai.NotFoundError) as caught:
            call(created.id)
        assert caught.value.body["code"] == "response_not_found"  # type: ignore[index]
    cancelled = owner.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.id == created.id
    assert _finished(owner, created.id).status == "cancelled"


def _finished(client: openai.OpenAI, response_id: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, response
        time.sleep(0.1)
    return response
