"""Structured outputs, tool calls and reasoning through a real server, with the clients people use: the ``openai``
SDK's ``.parse()``, instructor's JSON_SCHEMA and TOOLS modes, raw HTTP, streams and batches. The models have random
weights, so every structure in their outputs comes from the grammar (and the tool-call and reasoning markers of the
second server's model from a logit bias), and every output is checked against its schema."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

import instructor
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_helpers import LiveServer, chat_line

SKU = "^[A-Z]{3}-[0-9]{2}$"


class Person(BaseModel):
    name: Annotated[str, Field(max_length=8)]
    age: Annotated[int, Field(ge=0, le=120)]
    colour: Literal["red", "green", "blue"]


ORDER = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": SKU},
        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
        "gift": {"type": "boolean"},
    },
    "required": ["sku", "qty", "gift"],
    "additionalProperties": False,
}
PERSON = {**Person.model_json_schema(), "additionalProperties": False}  # as .parse() sends it: no other keys
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Oslo", "Rome", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "local_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
MESSAGES = [{"role": "user", "content": "Describe someone."}]


def _format(schema: dict[str, Any], name: str = "order") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0)


# --- the demo model: JSON schemas, regexes, choices -------------------------------------------------------------------


def test_the_sdk_parse_gives_a_valid_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model="demo",
        messages=MESSAGES,
        response_format=Person,
        max_tokens=400,  # type: ignore[arg-type]
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
    assert choice.message.parsed == Person.model_validate_json(choice.message.content or "")


def test_instructor_json_schema_mode(client: openai.OpenAI) -> None:
    patched = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA)
    person = patched.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        response_model=Person,
        max_tokens=400,
        max_retries=0,  # type: ignore[arg-type]
    )
    assert isinstance(person, Person)


def test_a_streamed_schema_output_validates(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        response_format=_format(ORDER),  # type: ignore[arg-type]
        max_tokens=400,
        temperature=1.0,
        seed=5,
        n=2,
        stream=True,
    )
    texts, finish = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert finish == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), ORDER)


@pytest.mark.parametrize(
    ("structured", "valid"),
    [
        ({"regex": r"[a-z]{3}-[0-9]{2,4}"}, lambda text: re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", text)),
        ({"choice": ["positive", "negative", "neutral"]}, lambda text: text in ("positive", "negative", "neutral")),
        (
            {"json": ORDER, "disable_any_whitespace": True},
            lambda text: jsonschema.validate(json.loads(text), ORDER) or " " not in text,
        ),
        (
            {"grammar": 'start: "yes" | "no" | NUMBER\nNUMBER: /[0-9]{1,3}/'},
            lambda text: re.fullmatch(r"yes|no|[0-9]{1,3}", text),
        ),
    ],
    ids=["regex", "choice", "json", "grammar"],
)
def test_vllm_structured_outputs_on_both_endpoints(
    client: openai.OpenAI, structured: dict[str, Any], valid: Callable[[str], Any]
) -> None:
    chat = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=300, extra_body={"structured_outputs": structured}
    )
    completion = client.completions.create(
        model="demo", prompt="Label:", max_tokens=300, n=2, temperature=1.0, seed=1,
        extra_body={"structured_outputs": structured},
    )  # fmt: skip
    texts = [chat.choices[0].message.content or ""] + [choice.text for choice in completion.choices]
    assert all(valid(text) for text in texts), texts


def test_vllms_json_bounds_whitespace_as_the_json_schema_format_does(client: openai.OpenAI) -> None:
    """Between tokens, a newline and 20 blanks at most, on both paths: with every blank favoured by a logit bias, at
    temperature 1, each output still ends, and both paths give the same text (a string value of blanks is the
    schema's to allow, and ORDER's pattern does not)."""
    bias = {str(ord(blank)): 30 for blank in " \t\r\n"}
    asked: dict[str, Any] = {"model": "demo", "messages": MESSAGES, "max_tokens": 400, "n": 3, "temperature": 1.0}
    vllm = client.chat.completions.create(
        **asked, seed=3, logit_bias=bias, extra_body={"structured_outputs": {"json": ORDER}}
    )
    openai_format = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}
    formatted = client.chat.completions.create(**asked, seed=3, logit_bias=bias, response_format=openai_format)
    assert [choice.finish_reason for choice in vllm.choices] == ["stop"] * 3
    texts = [choice.message.content or "" for choice in vllm.choices]
    assert texts == [choice.message.content for choice in formatted.choices]
    assert all("\n    " in text for text in texts)  # the blanks were favoured, and bounded
    for text in texts:
        jsonschema.validate(json.loads(text), ORDER)


def test_a_format_that_cannot_be_enforced_is_refused_naming_it(live_server: LiveServer) -> None:
    for extra, param, words in (
        ({"response_format": _format({"type": "array", "uniqueItems": True})}, "response_format", "uniqueItems"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "unclosed"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "one",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
    ):
        answer = live_server.http.post("/v1/chat/completions", json={"model": "demo", "messages": MESSAGES, **extra})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param and words in error["message"], error
    lenient = _format({"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2, "uniqueItems": True})
    lenient["json_schema"]["strict"] = False  # not strict: the keyword is ignored, the rest enforced
    answer = live_server.http.post(
        "/v1/chat/completions", json={"model": "demo", "messages": MESSAGES, "response_format": lenient}
    )
    assert answer.status_code == 200 and set(json.loads(answer.json()["choices"][0]["message"]["content"])) <= {1, 2}


def test_a_schema_that_compiles_for_seconds_holds_up_nobody(live_server: LiveServer) -> None:
    """A 3,000-property schema takes a second or more to validate and compile: meanwhile /health answers at once and
    another request runs to its end (before the fix, the event loop compiled it: /health waited seconds)."""
    import threading
    import time

    schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(3000)}}
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "fill it"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}},
    }
    answers: dict[str, Any] = {}
    slow = threading.Thread(
        target=lambda: answers.update(slow=live_server.http.post("/v1/chat/completions", json=body))
    )
    slow.start()
    health: list[float] = []
    other = None
    while slow.is_alive() and len(health) < 200:
        start = time.monotonic()
        assert live_server.http.get("/health").status_code == 200
        health.append(time.monotonic() - start)
        if other is None:
            plain = {"model": "demo", "prompt": "x", "max_tokens": 2}
            other = live_server.http.post("/v1/completions", json=plain)
            answers["other_done_while_compiling"] = slow.is_alive()
        time.sleep(0.02)
    slow.join(60)
    assert answers["slow"].status_code == 200, answers["slow"].text[:300]
    assert other is not None and other.status_code == 200 and answers["other_done_while_compiling"]
    assert len(health) >= 5 and max(health) < 0.5, health


def test_a_batch_with_a_schema_per_line_and_a_default_for_the_rest(live_server: LiveServer) -> None:
    """Each line's own format wins; the lines without one follow the batch's; a broken schema fails its line only."""
    lines = [chat_line(f"own-{i}", f"Order {i}", max_tokens=400, response_format=_format(ORDER)) for i in range(24)]
    lines += [chat_line(f"default-{i}", f"Person {i}", max_tokens=400, temperature=1.0, seed=i) for i in range(24)]
    lines.append(chat_line("regex", "Code", max_tokens=50, structured_outputs={"regex": "[A-Z]{2}[0-9]{3}"}))
    lines.append(chat_line("broken", "x", response_format=_format({"type": "object", "minProperties": "two"})))
    batch = live_server.run(lines, response_format=_format(PERSON, "person"))
    assert batch["status"] == "completed" and batch["response_format"]["json_schema"]["name"] == "person"
    assert batch["request_counts"] == {"total": 50, "completed": 49, "failed": 1}
    for line in live_server.lines(batch["output_file_id"]):
        text = line["response"]["body"]["choices"][0]["message"]["content"]
        if line["custom_id"] == "regex":
            assert re.fullmatch("[A-Z]{2}[0-9]{3}", text)
        else:
            jsonschema.validate(json.loads(text), ORDER if line["custom_id"].startswith("own") else PERSON)
    (broken,) = live_server.lines(batch["error_file_id"])
    error = broken["response"]["body"]["error"]
    assert (
        broken["custom_id"] == "broken" and error["param"] == "response_format" and "minProperties" in error["message"]
    )
    refused = live_server.http.post(
        "/v1/batches",
        json={"input_file_id": live_server.upload(lines[:1])["id"], "response_format": {"type": "json_schema"}},
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format.json_schema"


# --- a thinking model with tools: forced calls, parsed calls, reasoning -----------------------------------------------

TEMPLATE = """\
{%- if tools %}<|system|>
<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|assistant|>
{{ message.content }}{% for call in message.tool_calls or [] %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}
{% elif message.role == "tool" %}<|tool|>
<tool_response>{{ message.content }}</tool_response>
{% else %}<|{{ message.role }}|>
{{ message.content }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
"""Qwen3-Thinking's shape: the prompt opens the reasoning (``enable_thinking: false`` closes it), hermes tool calls."""
MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory, server_factory: Callable[..., LiveServer]) -> LiveServer:
    """A server with ``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`` over a random
    model whose tokenizer has Qwen's markers as tokens of their own (``ids`` holds them)."""
    from batchgen.server.engine.loading.demo_model import BOS, EOS, PAD, build_model, build_tokenizer

    path = tmp_path_factory.mktemp("thinker")
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(list(MARKERS))
    vocab = tokenizer.get_vocab()
    model = build_model(len(tokenizer), vocab[BOS], vocab[EOS], vocab[PAD], seed=7)
    model.generation_config.eos_token_id = vocab[EOS]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "template.jinja").write_text(TEMPLATE)
    server = server_factory(
        "--model", str(path), "--served-model-name", "thinker", "--chat-template", str(path / "template.jinja"),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
    )  # fmt: skip
    server.ids = {marker: vocab[marker] for marker in MARKERS}  # type: ignore[attr-defined]
    return server


def _thinker_client(thinker: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{thinker.base_url}/v1", api_key="unused", max_retries=0)


def test_instructor_tools_mode_gets_the_forced_call(thinker: LiveServer) -> None:
    patched = instructor.from_openai(_thinker_client(thinker), mode=instructor.Mode.TOOLS)
    person = patched.chat.completions.create(
        model="thinker", messages=MESSAGES, response_model=Person, max_tokens=400, max_retries=0, extra_body=NO_THINKING
    )  # type: ignore[arg-type]
    assert isinstance(person, Person)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_and_named_tool_choices_give_valid_arguments(thinker: LiveServer, parallel: bool) -> None:
    client = _thinker_client(thinker)
    required = client.chat.completions.create(
        model="thinker", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required",  # type: ignore[list-item]
        parallel_tool_calls=parallel, max_tokens=500, temperature=1.0, seed=3, n=3, extra_body=NO_THINKING,
    )  # fmt: skip
    named = client.chat.completions.create(
        model="thinker", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=300, extra_body=NO_THINKING,  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "local_time"}},
    )  # fmt: skip
    for choice in required.choices:
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls" and calls and (parallel or len(calls) == 1)
        for call in calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    (choice,) = named.choices
    (call,) = choice.message.tool_calls or []
    assert choice.finish_reason == "stop" and choice.message.content is None and call.function.name == "local_time"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["local_time"])


def _auto_call(thinker: LiveServer, seed: int, **extra: Any) -> dict[str, Any]:
    """A ``tool_choice: auto`` request whose model thinks, ends its thinking and writes a hermes call: the markers
    made likelier by a logit bias, the call's JSON by a structural tag (the random model would never write it)."""
    ids: dict[str, int] = thinker.ids  # type: ignore[attr-defined]
    tag = {
        "structures": [
            {
                "begin": '<tool_call>\n{"name": "weather", "arguments": ',
                "schema": PARAMETERS["weather"],
                "end": "}\n</tool_call>",
            }
        ],
        "triggers": ["<tool_call>"],
    }
    return {
        "model": "thinker",
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER],
        "max_tokens": 300,
        "temperature": 1.0,
        "seed": seed,
        "logit_bias": {str(ids["</think>"]): 3, str(ids["<tool_call>"]): 3},
        "structured_outputs": {"structural_tag": json.dumps(tag)},
        "stop": ["</tool_call>"],
        **extra,
    }


def test_auto_tool_calls_and_reasoning_are_parsed_whole_and_streamed(thinker: LiveServer) -> None:
    reasoning_tokens = 0
    for seed in (1, 3, 5):
        whole = thinker.http.post("/v1/chat/completions", json=_auto_call(thinker, seed)).json()
        (choice,) = whole["choices"]
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls", whole
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "weather" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS["weather"])
        assert message["reasoning"] == message["reasoning_content"] and message["reasoning"]
        assert "</think>" not in message["reasoning"] and "<tool_call>" not in (message["content"] or ""), message
        used = whole["usage"]["completion_tokens_details"]["reasoning_tokens"]
        assert 0 < used < whole["usage"]["completion_tokens"]
        reasoning_tokens += used

        body = _auto_call(thinker, seed, stream=True, stream_options={"include_usage": True})
        with thinker.http.stream("POST", "/v1/chat/completions", json=body) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        deltas = [event["choices"][0] for event in events if event["choices"]]
        assert "".join(d["delta"].get("reasoning", "") for d in deltas) == message["reasoning"]
        assert "".join(d["delta"].get("content", "") for d in deltas) == (message["content"] or "")
        (streamed,) = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
        assert (streamed["index"], streamed["function"]) == (0, call["function"])
        assert deltas[-1]["finish_reason"] == "tool_calls"
        assert events[-1]["usage"]["completion_tokens_details"] == whole["usage"]["completion_tokens_details"]

    lines = [
        {"custom_id": f"t{seed}", "method": "POST", "url": "/v1/chat/completions", "body": _auto_call(thinker, seed)}
        for seed in (1, 3, 5)
    ]
    batch = thinker.run(lines)
    assert batch["usage"]["output_tokens_details"]["reasoning_tokens"] == reasoning_tokens


def test_tool_results_render_in_the_follow_up(thinker: LiveServer) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo", "days": 1}'},
    }
    follow_up = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C and snow"},
    ]
    usage = []
    for messages in (MESSAGES, follow_up):
        answer = thinker.http.post(
            "/v1/chat/completions", json={"model": "thinker", "messages": messages, "tools": [WEATHER], "max_tokens": 1}
        )
        assert answer.status_code == 200, answer.text
        usage.append(answer.json()["usage"]["prompt_tokens"])
    assert usage[1] - usage[0] > len('{"city": "Oslo", "days": 1}') + len("-3 C and snow")  # the call and its result


def test_responses_say_reasoning_and_calls_as_output_items(thinker: LiveServer) -> None:
    chat = _auto_call(thinker, 1)
    message = thinker.http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]
    shared = {name: chat[name] for name in ("temperature", "seed", "logit_bias", "structured_outputs", "stop")}
    tools = [{"type": "function", **WEATHER["function"]}]
    body = {"model": "thinker", "input": chat["messages"], "tools": tools, "max_output_tokens": 300, **shared}
    response = thinker.http.post("/v1/responses", json=body).json()
    kinds = [item["type"] for item in response["output"]]
    assert response["status"] == "completed" and kinds[0] == "reasoning" and kinds[-1] == "function_call", response
    reasoning, call = response["output"][0], response["output"][-1]
    assert reasoning["content"][0]["text"] == message["reasoning"]
    assert (call["name"], call["arguments"]) == ("weather", message["tool_calls"][0]["function"]["arguments"])
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] > 0

    with thinker.http.stream("POST", "/v1/responses", json={**body, "stream": True}) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
    reasoned = "".join(event["delta"] for event in events if event["type"] == "response.reasoning_text.delta")
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert reasoned == message["reasoning"] and arguments == call["arguments"]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and [item["type"] for item in final["output"]] == kinds

    forced = _thinker_client(thinker).responses.create(
        model="thinker", input="Weather?", tools=tools, tool_choice="required", max_output_tokens=500, temperature=1.0,  # type: ignore[arg-type]
        extra_body={**NO_THINKING, "seed": 3},
    )  # fmt: skip
    calls = [item for item in forced.output if item.type == "function_call"]
    assert forced.status == "completed" and calls, forced
    assert all(call.name == "weather" for call in calls)
    for forced_call in calls:
        jsonschema.validate(json.loads(forced_call.arguments), PARAMETERS["weather"])
