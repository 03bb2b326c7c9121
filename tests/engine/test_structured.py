"""Structured outputs on the real engine with the random-weight demo model: every structure in its outputs comes from
the grammar, so each output validates (jsonschema, a regex's fullmatch, a choice's membership), greedy or sampled,
with n > 1, under preemption, on a prefix-cache hit, and a sampled output is the same whatever shares its batch."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import jsonschema
import msgspec
import pytest

from batchgen.schemas import BODY_TYPES, BatchInputLine, ChatCompletion, TextCompletion
from batchgen.server.engine import EngineRequest, EngineResult, LLMEngine, SamplingParams
from batchgen.server.serving import BatchDefaults, OpenAIServing
from batchgen.server.serving.structured import output_constraint

Run = Callable[..., dict[str, EngineResult]]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["open", "paid", "shipped"]},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 6}]},
    },
    "required": ["id", "lines", "status", "note"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma delta"]
CLOSING = {str(ord('"')): 3.0, str(ord("}")): 3.0}
"""Byte tokens of the demo tokenizer that close a JSON string and an object, made likelier."""


def _line(url: str, body: dict[str, Any], custom_id: str = "c") -> BatchInputLine:
    typed = msgspec.convert({"model": "demo", **body}, BODY_TYPES[url])
    return BatchInputLine(custom_id=custom_id, method="POST", url=url, body=typed)


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}


def _valid(kind: str, spec: Any, text: str) -> bool:
    if kind == "schema":
        jsonschema.validate(json.loads(text), spec)
        return True
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    return text in spec


CASES = [
    ("schema", PERSON, {"response_format": _schema_format(PERSON)}),
    ("schema", ORDER, {"structured_outputs": {"json": ORDER, "disable_any_whitespace": True}}),
    ("regex", REGEX, {"structured_outputs": {"regex": REGEX}}),
    ("choice", CHOICES, {"structured_outputs": {"choice": CHOICES}}),
]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3, "n": 3}], ids=["greedy", "sampled-n3"])
def test_every_constrained_chat_output_validates(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, sampling: dict[str, Any]
) -> None:
    engine = make_engine()
    serving = OpenAIServing(engine.tokenizer, ("demo",), engine.max_context_length, engine.vocab_size)
    prepared = []
    for i, (_, _, constraint) in enumerate(CASES):
        messages = [{"role": "user", "content": f"question {i}"}]
        line = _line("/v1/chat/completions", {"messages": messages, "max_tokens": 500, **constraint, **sampling})
        prepared.append(serving.prepare(line.body, request_id=f"r{i}", defaults=BatchDefaults()))
    results = run_to_completion(engine, [r for p in prepared for r in p.requests])
    for (kind, spec, _), line in zip(CASES, prepared, strict=True):
        out = serving.output_line("x", line, [results[r.request_id] for r in line.requests])
        body = out.response.body
        assert isinstance(body, ChatCompletion) and len(body.choices) == sampling.get("n", 1)
        for choice in body.choices:
            assert choice.finish_reason == "stop", choice.message.content
            assert _valid(kind, spec, choice.message.content or ""), choice.message.content


def test_completions_take_a_json_object_format_and_a_batch_default(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run
) -> None:
    engine = make_engine()
    serving = OpenAIServing(engine.tokenizer, ("demo",), engine.max_context_length, engine.vocab_size)
    defaults = msgspec.convert({"response_format": _schema_format(PERSON)}, BatchDefaults)
    bodies = [
        ({"prompt": ["a", "b"], "max_tokens": 300}, PERSON),  # the batch's default, for each prompt
        (  # any object: the random model would write an endless key; a nudge towards closing ends it
            {"prompt": "c", "max_tokens": 300, "response_format": {"type": "json_object"}, "logit_bias": CLOSING},
            {"type": "object"},
        ),
        (
            {"prompt": "d", "max_tokens": 300, "structured_outputs": {"json": ORDER, "disable_any_whitespace": True}},
            ORDER,
        ),
    ]
    for i, (body, schema) in enumerate(bodies):
        line = _line("/v1/completions", body)
        prepared = serving.prepare(line.body, request_id=f"r{i}", defaults=defaults)
        requests = prepared.requests
        results = run_to_completion(engine, requests)
        out = serving.output_line("x", prepared, [results[r.request_id] for r in requests]).response
        assert isinstance(out.body, TextCompletion) and len(out.body.choices) == len(requests)
        for choice in out.body.choices:
            jsonschema.validate(json.loads(choice.text), schema)


def _constrained(rid: str, prompt: list[int], grammar: str, **params: Any) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=500, grammar=grammar, **params))


@pytest.fixture(scope="module")
def grammars(tokenizer: Any) -> dict[str, str]:
    """The llguidance grammars of the schemas, as the serving layer makes them."""
    made = {}
    for name, constraint_field in (
        ("person", {"response_format": _schema_format(PERSON)}),
        ("order", {"structured_outputs": {"json": ORDER, "disable_any_whitespace": True}}),
    ):
        body = msgspec.convert({"model": "demo", "prompt": "x", **constraint_field}, BODY_TYPES["/v1/completions"])
        constraint = output_constraint(body, None)
        assert constraint is not None
        made[name] = constraint.grammar
    return made


def test_sampled_constrained_outputs_survive_preemption_and_do_not_depend_on_the_batch(
    make_engine: Callable[..., LLMEngine],
    run_to_completion: Run,
    random_prompts: Callable[..., list[list[int]]],
    grammars: dict[str, str],
) -> None:
    """A constrained sampled request alone, and among unconstrained and constrained neighbours in an engine so short
    of KV blocks that it preempts: the same tokens, and every constrained output valid."""
    prompts = random_prompts(10, 20, 60, seed=11)
    subject = _constrained("subject", prompts[0], grammars["order"], temperature=1.0, seed=42, n=2)
    alone = run_to_completion(make_engine(), [subject])["subject"]
    neighbours = [
        _constrained(f"c{i}", p, grammars["person" if i % 2 else "order"], temperature=0.8, seed=i)
        for i, p in enumerate(prompts[1:6])
    ]
    neighbours += [
        EngineRequest(f"u{i}", p, SamplingParams(max_tokens=120, temperature=1.0, seed=i, ignore_eos=True))
        for i, p in enumerate(prompts[6:])
    ]
    engine = make_engine(num_kv_blocks=40, max_num_batched_tokens=64)
    crowded = run_to_completion(engine, [*neighbours[:3], subject, *neighbours[3:]])
    assert engine.stats().preemptions > 0
    assert [o.token_ids for o in crowded["subject"].outputs] == [o.token_ids for o in alone.outputs]
    for rid, result in crowded.items():
        if rid.startswith("u"):
            continue
        schema = PERSON if rid.startswith("c") and int(rid[1:]) % 2 else ORDER
        for output in result.outputs:
            assert output.finish_reason == "stop"
            jsonschema.validate(json.loads(output.text), schema)


def test_a_prefix_cache_hit_keeps_the_grammar(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, grammars: dict[str, str]
) -> None:
    engine = make_engine()
    prompt = list(range(40, 104))  # four whole blocks: the second request finds them cached
    first = run_to_completion(engine, [_constrained("a", prompt, grammars["person"])])["a"]
    second = run_to_completion(engine, [_constrained("b", prompt, grammars["person"])])["b"]
    assert first.cached_tokens == 0 and second.cached_tokens >= 48
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    jsonschema.validate(json.loads(second.outputs[0].text), PERSON)


def test_a_grammar_that_can_only_end_ends_the_output_before_min_tokens(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run
) -> None:
    """min_tokens bans the stop tokens, and a finished grammar allows nothing else: the grammar ends the output."""
    engine = make_engine()
    serving = OpenAIServing(engine.tokenizer, ("demo",), engine.max_context_length, engine.vocab_size)
    body = {"prompt": [0], "max_tokens": 40, "min_tokens": 30, "structured_outputs": {"json": {"enum": [3]}}}
    for sampling in ({}, {"temperature": 1.0, "seed": 1}):
        line = _line("/v1/completions", {**body, **sampling})
        requests = serving.prepare(line.body, request_id="r", defaults=BatchDefaults()).requests
        ((output,),) = [result.outputs for result in run_to_completion(engine, requests).values()]
        assert (output.text, output.finish_reason) == ("3", "stop")


def test_a_grammar_the_engine_cannot_build_fails_only_its_request(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, grammars: dict[str, str]
) -> None:
    results = run_to_completion(
        make_engine(),
        [_constrained("bad", [5, 6, 7], "start: undefined_rule"), _constrained("good", [5, 6, 7], grammars["person"])],
    )
    error = results["bad"].error
    assert error is not None and error.code == "invalid_grammar" and "undefined_rule" in error.message
    assert results["good"].error is None
    jsonschema.validate(json.loads(results["good"].outputs[0].text), PERSON)


def test_the_grammar_constrains_what_follows_the_end_of_the_reasoning(
    make_engine: Callable[..., LLMEngine], run_to_completion: Run, tokenizer: Any
) -> None:
    """``grammar_after``: free text up to the marker (here ``#``, made likely by a logit bias), then the grammar."""
    hash_id = tokenizer.convert_tokens_to_ids("#")
    body = msgspec.convert(
        {"model": "demo", "prompt": "x", "structured_outputs": {"choice": CHOICES}}, BODY_TYPES["/v1/completions"]
    )
    constraint = output_constraint(body, None)
    assert constraint is not None
    requests = [
        EngineRequest(
            f"r{seed}",
            [70, 80, 90],
            SamplingParams(
                max_tokens=200,
                temperature=1.0,
                seed=seed,
                logit_bias={hash_id: 4.0},
                grammar=constraint.grammar,
                grammar_after=(hash_id,),
            ),
        )
        for seed in range(6)
    ]
    results = run_to_completion(make_engine(), requests)
    thoughts = []
    for result in results.values():
        text = result.outputs[0].text
        thought, answer = text.split("#", 1)
        assert answer in CHOICES and result.outputs[0].finish_reason == "stop", text
        thoughts.append(thought)
    assert any(len(thought) > 2 for thought in thoughts)  # the reasoning itself was free: not the grammar's


def test_refused_schemas_leave_no_memory_behind() -> None:
    """100 distinct 3 MB schemas, each refused: what is remembered of each is its hash and the reason, not its text."""
    import gc
    import os
    from pathlib import Path

    from batchgen.schemas.requests import JsonSchemaFormat, ResponseFormat
    from batchgen.server.serving import RequestRejected
    from batchgen.server.serving.structured import format_constraint

    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def refuse(index: int) -> None:
        schema = {"type": "array", "uniqueItems": True, "description": f"{index:04d}" + "x" * 3_000_000}
        strict = JsonSchemaFormat(name="s", schema_=schema, strict=True)
        response_format = ResponseFormat(type="json_schema", json_schema=strict)
        with pytest.raises(RequestRejected, match="uniqueItems"):
            format_constraint(response_format)

    refuse(-1)
    gc.collect()
    before = resident()
    for index in range(100):
        refuse(index)
    gc.collect()
    assert resident() - before < 40 * 2**20  # the texts would be 300 MB


def test_compilations_past_their_limit_give_their_places_to_the_next() -> None:
    """Native compilations cannot be interrupted: one given up on runs on in its thread, and the next one starts at
    once in another (here the slow work waits on an event, standing in for a pathological grammar)."""
    from concurrent.futures import Future

    from batchgen.server.engine.sampling.grammar import Compilations, GrammarError

    pool = Compilations(threads=2, timeout_s=0.2)
    release = threading.Event()
    late: list[str] = []
    stuck: list[Future[str]] = [Future() for _ in range(3)]
    for index, future in enumerate(stuck):
        pool.run(lambda index=index: release.wait() and f"slow-{index}", future, late.append)  # type: ignore[misc]
    for future in stuck:
        with pytest.raises(GrammarError, match=r"did not compile within 0\.2 s"):
            future.result(timeout=5)
    quick: Future[str] = Future()
    pool.run(lambda: "quick", quick, late.append)
    assert quick.result(timeout=1) == "quick"  # not queued behind the three still running
    release.set()
    deadline = time.monotonic() + 5
    while len(late) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(late) == ["slow-0", "slow-1", "slow-2"]  # kept for the next requests of their grammars


def test_a_grammar_compiled_after_its_limit_serves_the_next_requests(tokenizer: Any) -> None:
    from batchgen.server.engine.sampling.grammar import GrammarCompiler, GrammarError
    from batchgen.server.serving.structured import json_grammar

    compiler = GrammarCompiler(tokenizer, len(tokenizer), timeout_s=0.01)
    grammar = json_grammar(
        {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(400)}}, lenient=False
    )
    with pytest.raises(GrammarError, match="did not compile within"):
        compiler.compile(grammar)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        future = compiler.start(grammar)
        if future.done() and future.exception() is None:
            break
        time.sleep(0.02)
    assert compiler.matcher(grammar).is_accepting() is False  # a fresh matcher at the grammar's start


def test_objects_are_closed_unless_the_schema_says_otherwise(tokenizer: Any) -> None:
    """pydantic's schemas do not say ``additionalProperties``: an object takes its listed keys only (as xgrammar,
    vLLM's default backend, reads it), so a model cannot go on adding keys; a schema that allows more keeps them."""
    import llguidance
    import llguidance.hf

    from batchgen.server.serving.structured import json_grammar

    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def accepts(schema: dict[str, Any], text: str) -> bool:
        matcher = llguidance.LLMatcher(lltokenizer, json_grammar(schema, lenient=False), log_level=0)
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    person = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "pet": {"$ref": "#/$defs/Pet"}, "properties": {"type": "integer"}},
        "$defs": {"Pet": {"type": "object", "properties": {"kind": {"type": "string"}}}},
    }
    assert accepts(person, '{"name":"Ada","pet":{"kind":"cat"},"properties":3}')
    assert not accepts(person, '{"name":"Ada","age":3}')
    assert not accepts(person, '{"pet":{"kind":"cat","age":3}}')  # nested ones too
    assert accepts({**person, "additionalProperties": True}, '{"name":"Ada","age":3}')
    assert accepts({"type": "object"}, '{"any":1}')  # no listed keys: any object
