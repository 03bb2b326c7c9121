"""Property: no request body reaches code that raises on it. Bodies are drawn from the request types themselves
(``msgspec.inspect``: every field, its bounds, edge values, free-form JSON nested deep, dict keys of any text) and
sent online and as batch lines to a live server: online, a body is answered 2xx or 4xx, never 5xx; in a batch, a line
the validator refuses fails the batch at validation naming that line, and any other line is answered with the status
it gets online while every good line beside it is answered 200."""

from __future__ import annotations

import io
import json
from typing import Any

import msgspec.inspect as mi
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from server_helpers import LiveServer, chat_line

from batchgen.schemas import BODY_TYPES, CompletionRequest
from batchgen.schemas.pooling import RerankRequest, ScoreRequest
from batchgen.schemas.validation import LineError, iter_input_lines

JSON_LEAVES = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
)
JSON = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)


ODD_TEXT = ["", "0", "007", "-1", "²", "٣", "1" * 4300, "\u202e", "x", "{{ 7 * 7 }}"]
"""Texts that pass a loose check and break a strict one: unicode digits (``str.isdigit`` but not ``int()``), a number
past ``int()``'s default digit limit, a bidi override, a template expression."""


def _nested(depth: int) -> Any:
    value: Any = 0
    for level in range(depth):
        value = [value] if level % 2 else {"a": value}
    return value


FREE_FORM = JSON | st.integers(60, 80).map(_nested)
"""Free-form values, some nested past the server's bound (64)."""


def _number(info: mi.IntType | mi.FloatType) -> st.SearchStrategy[Any]:
    low = info.ge if info.ge is not None else info.gt
    high = info.le if info.le is not None else info.lt
    if isinstance(info, mi.IntType):
        edges = [v for v in (low, high, 0, 1, -1) if v is not None]
        return st.sampled_from(edges) | st.integers(low, high)
    edges = [float(v) for v in (low, high, 0.0, 1.0) if v is not None]
    options = {
        "min_value": low,
        "max_value": high,
        "exclude_min": info.gt is not None,
        "exclude_max": info.lt is not None,
    }
    return st.sampled_from(edges) | st.floats(allow_nan=False, allow_infinity=False, **options)


def strategy(info: mi.Type) -> st.SearchStrategy[Any]:
    """JSON values of the type ``info`` describes: what the typed decoder accepts (edge values included)."""
    if isinstance(info, mi.Metadata):
        return strategy(info.type)
    if isinstance(info, mi.IntType | mi.FloatType):
        return _number(info)
    if isinstance(info, mi.StrType):
        return st.sampled_from(ODD_TEXT) | st.text(max_size=12)
    if isinstance(info, mi.BoolType):
        return st.booleans()
    if isinstance(info, mi.NoneType):
        return st.none()
    if isinstance(info, mi.LiteralType):
        return st.sampled_from(info.values)
    if isinstance(info, mi.AnyType):
        return FREE_FORM
    if isinstance(info, mi.UnionType):
        return st.one_of(*(strategy(t) for t in info.types))
    if isinstance(info, mi.ListType):
        return st.lists(strategy(info.item_type), min_size=info.min_length or 0, max_size=min(info.max_length or 4, 4))
    if isinstance(info, mi.DictType):
        return st.dictionaries(strategy(info.key_type), strategy(info.value_type), max_size=3)
    if isinstance(info, mi.StructType):
        return _struct(info)
    raise TypeError(f"no strategy for {info}")


def _struct(info: mi.StructType) -> st.SearchStrategy[dict[str, Any]]:
    """Its required fields, up to six others, and now and then one that batchgen does not support."""
    required = {f.encode_name: strategy(f.type) for f in info.fields if f.required}
    if info.tag_field is not None:
        required[info.tag_field] = st.just(info.tag)
    optional = {f.encode_name: f for f in info.fields if not f.required and not _unsupported(f)}
    rarely = [f.encode_name for f in info.fields if not f.required and _unsupported(f)]
    names = (
        st.lists(st.sampled_from(sorted(optional)), max_size=min(6, len(optional)), unique=True)
        if optional
        else st.just([])
    )
    odd = st.one_of(st.just([]), st.just([]), st.lists(st.sampled_from(rarely), max_size=1)) if rarely else st.just([])
    chosen = st.tuples(names, odd).map(lambda pair: pair[0] + pair[1])
    types = {f.encode_name: f.type for f in info.fields}
    return st.tuples(
        st.fixed_dictionaries(required),
        chosen.flatmap(lambda keys: st.fixed_dictionaries({key: strategy(types[key]) for key in keys})),
    ).map(lambda pair: {**pair[0], **pair[1]})


def _unsupported(field: mi.Field) -> bool:
    return isinstance(field.type, mi.Metadata) and "Not supported" in str(field.type.extra_json_schema)


def _runnable(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body, bounded to finish quickly on the demo model (what it tests is validation, not generation)."""
    body = {**body, "model": "demo"}
    body.pop("stream", None)
    body.pop("stream_options", None)
    if url != "/v1/embeddings":
        body["max_tokens"] = min(body.get("max_tokens") or 2, 2)
        body.pop("max_completion_tokens", None)
        body["n"] = min(body.get("n", 1), 2)
    return body


BODIES = st.sampled_from(sorted(BODY_TYPES)).flatmap(
    lambda url: st.tuples(st.just(url), _struct(mi.type_info(BODY_TYPES[url])).map(lambda b: _runnable(url, b)))  # type: ignore[arg-type]
)


def _validates(url: str, body: dict[str, Any]) -> bool:
    line = json.dumps({"custom_id": "x", "method": "POST", "url": url, "body": body}).encode() + b"\n"
    return not any(isinstance(item, LineError) for item in iter_input_lines(io.BytesIO(line)))


def _good(url: str, custom_id: str) -> dict[str, Any]:
    if url == "/v1/chat/completions":
        return chat_line(custom_id, max_tokens=2)
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": GOOD_BODIES.get(BODY_TYPES[url], INPUT)}


INPUT = {"model": "demo", "input": "hi"}
GOOD_BODIES: dict[type, dict[str, Any]] = {
    CompletionRequest: {"model": "demo", "prompt": "hi", "max_tokens": 2},
    ScoreRequest: {"model": "demo", "text_1": "hi", "text_2": "there"},
    RerankRequest: {"model": "demo", "query": "hi", "documents": ["there"]},
}
"""A line each endpoint's validator accepts (the demo model, a generator, answers some of them 400 unsupported_endpoint
online, and refuses batches at those endpoints when they are created)."""


CHAT = {"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
ATTACKS = [
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"²": 1}}),
    ("/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 2, "logit_bias": {"1" * 4300: 1}}),
    ("/v1/chat/completions", {**CHAT, "tools": [_nested(70)]}),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"e": _nested(900)}}),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"a": 10**28}}}},
    ),
    ("/v1/completions", {"model": "demo", "prompt": "x", "structured_outputs": {"json": {"maximum": 10**4299}}}),
    (
        "/v1/completions",
        {
            "model": "demo",
            "prompt": [0],
            "max_tokens": 2,
            "temperature": 1e-40,
            "response_format": {"type": "json_object"},
        },
    ),
]
"""What the attack found, always among the examples."""


@settings(max_examples=6, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(drawn=st.lists(BODIES, min_size=30, max_size=30))
@example(drawn=ATTACKS)
def test_bodies_are_answered_4xx_or_2xx_online_and_line_by_line_in_batches(
    live_server: LiveServer, drawn: list[tuple[str, dict[str, Any]]]
) -> None:
    online: dict[int, int] = {}
    for index, (url, body) in enumerate(drawn):
        response = live_server.http.post(url, json=body)
        assert response.status_code < 500, (url, body, response.text)
        if response.status_code >= 400:
            assert response.json()["error"]["message"], response.text
        online[index] = response.status_code
    for url in BODY_TYPES:
        mine = [(index, body) for index, (line_url, body) in enumerate(drawn) if line_url == url]
        valid = [(index, body) for index, body in mine if _validates(url, body)]
        invalid = [(index, body) for index, body in mine if not _validates(url, body)]
        for index, _ in invalid:
            assert 400 <= online[index] < 500  # what the validator refuses, online refuses too
        good = live_server.http.post(url, json=_good(url, "good")["body"])
        if good.status_code == 400:  # an endpoint the model does not serve: its batches are refused at creation
            assert good.json()["error"]["code"] == "unsupported_endpoint"
            refused = live_server.http.post(
                "/v1/batches", json={"input_file_id": "file-x", "endpoint": url, "completion_window": "24h"}
            )
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_endpoint"
            assert refused.json()["error"]["param"] == "endpoint"
            continue
        if valid:
            lines = [_good(url, "good-0")]
            lines += [
                {"custom_id": f"line-{index}", "method": "POST", "url": url, "body": body} for index, body in valid
            ]
            lines.append(_good(url, "good-1"))
            batch = live_server.run(lines, endpoint=url, completion_window="24h")
            assert batch["status"] == "completed", batch
            answered = {
                line["custom_id"]: line["response"]["status_code"]
                for kind in ("output_file_id", "error_file_id")
                for line in live_server.lines(batch[kind])
            }
            assert answered.pop("good-0") == answered.pop("good-1") == good.status_code == 200
            assert answered == {f"line-{index}": online[index] for index, _ in valid}
        if invalid:
            index, body = invalid[0]
            lines = [
                _good(url, "good-0"),
                {"custom_id": "bad", "method": "POST", "url": url, "body": body},
                _good(url, "good-1"),
            ]
            upload = live_server.http.post(
                "/v1/files",
                data={"purpose": "batch"},
                files={"file": ("in.jsonl", b"".join(json.dumps(line).encode() + b"\n" for line in lines))},
            )
            if upload.status_code == 200:
                batch = live_server.wait(
                    live_server.create_batch(upload.json()["id"], endpoint=url, completion_window="24h")["id"]
                )
                assert batch["status"] == "failed"
                assert [error["line"] for error in batch["errors"]["data"]] == [2]
            else:
                assert upload.status_code == 422 and "line 2" in upload.json()["error"]["message"]
