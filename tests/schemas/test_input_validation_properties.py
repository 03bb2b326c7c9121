"""Property-based checks: the validator never raises, accounts for every line, and does not depend on chunking."""

from __future__ import annotations

import io
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.schemas import BatchInputLine
from batchgen.schemas.validation import LineError, ValidationLimits, check_upload, iter_input_lines, validate_input_file

from .test_input_validation import Trickle

FILE_LEVEL = {"empty_file", "file_too_large", "too_many_requests"}
SMALL_LIMITS = ValidationLimits(max_requests=20, max_line_bytes=400, max_file_bytes=6000)

keys = st.sampled_from(
    [
        "custom_id", "method", "url", "body", "model", "messages", "role", "content", "prompt", "input", "stream",
        "temperature", "top_p", "top_k", "max_tokens", "n", "stop", "type", "text", "logprobs", "top_logprobs",
    ]
)  # fmt: skip
words = st.sampled_from(
    ["POST", "GET", "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "demo", "other", "user", "bot",
     "text", "", "a", "b"]
)  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | words
    | st.text(max_size=4)
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=4))
roles = st.sampled_from(["system", "user", "assistant", "bot"])
messages = st.lists(
    st.fixed_dictionaries({"role": roles, "content": st.text(max_size=8) | values}), min_size=1, max_size=3
)
urls = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
prompts = st.text(max_size=8) | st.lists(st.integers(-1, 9), max_size=3) | values
bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["demo", "other"])},
    optional={
        "messages": messages,
        "prompt": prompts,
        "input": prompts,
        "stream": st.booleans(),
        "temperature": values,
    },
)
requests = st.fixed_dictionaries(
    {
        "custom_id": words | st.uuids().map(str),
        "method": st.just("POST") | words,
        "url": urls | words,
        "body": st.one_of(bodies, bodies, values),
    },
    optional={"extra": values},
)

TEMPLATES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
    "/v1/completions": {"model": "demo", "prompt": "Once", "max_tokens": 8},
    "/v1/embeddings": {"model": "demo", "input": ["a", "b"]},
}


@st.composite
def near_valid_requests(draw: st.DrawFn) -> dict[str, Any]:
    """A valid request of the file's usual endpoint, with at most a couple of body fields changed."""
    url = draw(st.sampled_from(list(TEMPLATES)[:1] * 3 + list(TEMPLATES)))
    changes = draw(st.dictionaries(keys, values, max_size=2) | st.just({}))
    body = TEMPLATES[url] | changes
    return {"custom_id": draw(st.uuids().map(str) | words), "method": "POST", "url": url, "body": body}


@st.composite
def json_ish_lines(draw: st.DrawFn) -> bytes:
    line = json.dumps(draw(st.one_of(near_valid_requests(), near_valid_requests(), requests, values))).encode()
    if draw(st.integers(0, 9)) == 0:  # sometimes cut it short or corrupt a byte
        cut = draw(st.integers(0, len(line)))
        line = line[:cut] + draw(st.binary(max_size=2)) + line[cut + 1 :]
    return line


json_ish_files = st.lists(json_ish_lines() | st.sampled_from([b"", b"  ", b"\r"]), max_size=12).map(
    lambda lines: b"\n".join(lines) + b"\n"
)
any_files = st.binary(max_size=2000) | json_ish_files


def check_accounting(data: bytes, items: list[BatchInputLine | LineError], limits: ValidationLimits) -> None:
    """One item per non-blank line, in order, unless a file-level error ended the file (it comes last)."""
    physical = data.split(b"\n")
    non_blank = [number for number, line in enumerate(physical, start=1) if line.strip()]
    last = items[-1] if items else None
    stopped = isinstance(last, LineError) and last.code in FILE_LEVEL
    per_line = items[:-1] if stopped else items
    assert all(not (isinstance(item, LineError) and item.code in FILE_LEVEL) for item in per_line)
    line_errors = [item for item in per_line if isinstance(item, LineError)]
    assert all(error.line in non_blank for error in line_errors)
    assert [e.line for e in line_errors] == sorted(e.line for e in line_errors if e.line is not None)
    if not stopped:
        assert len(per_line) == len(non_blank)
    elif last is not None and last.code == "empty_file":
        assert non_blank == [] and per_line == []
    elif last is not None and last.code == "too_many_requests":
        assert last.line == non_blank[limits.max_requests] and len(per_line) == limits.max_requests


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=any_files)
def test_never_raises_and_accounts_for_every_line(data: bytes) -> None:
    for limits in (ValidationLimits(), SMALL_LIMITS):
        items = list(iter_input_lines(io.BytesIO(data), limits=limits))
        check_accounting(data, items, limits)
        report = validate_input_file(io.BytesIO(data), limits=limits, max_errors=5)
        assert report.error_count == sum(isinstance(item, LineError) for item in items)
        assert report.errors == [item for item in items if isinstance(item, LineError)][:5]
        check_upload(io.BytesIO(data), limits)


@settings(max_examples=150, deadline=None)
@given(data=any_files, size=st.integers(1, 64))
def test_results_do_not_depend_on_how_the_file_is_chunked(data: bytes, size: int) -> None:
    expected = list(iter_input_lines(io.BytesIO(data), limits=SMALL_LIMITS))
    assert list(iter_input_lines(Trickle(data, size), limits=SMALL_LIMITS)) == expected  # type: ignore[arg-type]
    assert check_upload(Trickle(data, size), SMALL_LIMITS) == check_upload(io.BytesIO(data), SMALL_LIMITS)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(data=json_ish_files)
def test_a_file_that_passes_the_upload_check_has_no_syntax_errors(data: bytes) -> None:
    if check_upload(io.BytesIO(data)) is not None:
        return
    codes = {item.code for item in iter_input_lines(io.BytesIO(data)) if isinstance(item, LineError)}
    assert not codes & {"invalid_json_line", "invalid_encoding", "line_too_long", "empty_file"}


@settings(max_examples=100, deadline=None)
@given(items=st.lists(st.tuples(words, st.text(max_size=20)), min_size=1, max_size=10))
def test_valid_requests_pass_through_unchanged(items: list[tuple[str, str]]) -> None:
    lines: list[dict[str, Any]] = [
        {
            "custom_id": f"{i}-{custom}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "demo", "messages": [{"role": "user", "content": text}]},
        }
        for i, (custom, text) in enumerate(items)
    ]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    results = list(iter_input_lines(io.BytesIO(data)))
    assert all(isinstance(result, BatchInputLine) for result in results)
    assert [(r.custom_id, r.body.messages[0].content) for r in results] == [  # type: ignore[union-attr]
        (line["custom_id"], line["body"]["messages"][0]["content"]) for line in lines
    ]
