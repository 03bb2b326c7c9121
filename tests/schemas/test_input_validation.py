"""The streaming input-file validator: typed lines, every error code with its line and param, limits, upload check."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from batchgen.schemas import (
    BatchError,
    BatchInputLine,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from batchgen.schemas.validation import (
    DEFAULT_LIMITS,
    LineError,
    UploadChecker,
    ValidationLimits,
    check_upload,
    iter_input_lines,
    validate_input_file,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_line(custom_id: str = "r1", **body: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": fields | body}


def jsonl(*lines: dict[str, Any] | bytes) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def run(data: bytes, **kwargs: Any) -> list[BatchInputLine | LineError]:
    return list(iter_input_lines(io.BytesIO(data), **kwargs))


def errors(data: bytes, **kwargs: Any) -> list[LineError]:
    return [item for item in run(data, **kwargs) if isinstance(item, LineError)]


def only_error(data: bytes, **kwargs: Any) -> LineError:
    (error,) = errors(data, **kwargs)
    return error


class Trickle:
    """A binary file object that returns at most ``size`` bytes per read, to split lines across chunks."""

    def __init__(self, data: bytes, size: int) -> None:
        self._data, self._size, self._pos = data, size, 0

    def read(self, n: int = -1) -> bytes:
        chunk = self._data[self._pos : self._pos + min(n, self._size)]
        self._pos += len(chunk)
        return chunk


# --- valid files ---------------------------------------------------------------------------------------------------


def test_valid_chat_file_yields_typed_lines() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
        ],
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 1,
        "stop": ["\n"],
        "logprobs": True,
        "top_logprobs": 2,
        "response_format": {"type": "json_object"},
        "stream": False,
        "user": "u-1",  # a no-op, as at OpenAI
    }
    items = run(jsonl(chat_line("a", **body), chat_line("b")))
    assert [type(item) for item in items] == [BatchInputLine, BatchInputLine]
    first = items[0]
    assert isinstance(first, BatchInputLine)
    assert (first.custom_id, first.method, first.url) == ("a", "POST", CHAT)
    assert isinstance(first.body, ChatCompletionRequest)
    assert first.body.messages[1].text() == "Hello there"
    assert (first.body.temperature, first.body.top_k, first.body.stop, first.body.top_logprobs) == (0.7, 40, ["\n"], 2)


@pytest.mark.parametrize("prompt", ["Once upon a time", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_valid_completion_prompts(prompt: Any) -> None:
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"model": "demo", "prompt": prompt}}
    (item,) = run(jsonl(line), endpoint="/v1/completions")
    assert isinstance(item, BatchInputLine) and isinstance(item.body, CompletionRequest)
    assert item.body.prompt == prompt


@pytest.mark.parametrize("text", ["hello", ["a", "b"], [5, 6], [[5], [6, 7]]])
def test_valid_embedding_inputs(text: Any) -> None:
    body = {"model": "demo", "input": text, "encoding_format": "base64", "dimensions": 8}
    (item,) = run(jsonl({"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": body}))
    assert isinstance(item, BatchInputLine) and isinstance(item.body, EmbeddingRequest)
    assert (item.body.input, item.body.encoding_format, item.body.dimensions) == (text, "base64", 8)


def test_sources_path_str_and_file_object(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(chat_line("a"), chat_line("b")))
    for source in (path, str(path)):
        assert [item.custom_id for item in iter_input_lines(source) if isinstance(item, BatchInputLine)] == ["a", "b"]
    with path.open("rb") as file:
        assert validate_input_file(file).ok


def test_blank_lines_are_skipped_and_line_numbers_stay_physical() -> None:
    data = b"\n" + jsonl(chat_line("a")) + b"   \n\r\n" + json.dumps(chat_line("a")).encode() + b"\r\n\n"
    items = run(data)
    assert isinstance(items[0], BatchInputLine)
    assert items[1] == LineError(
        line=5,
        code="duplicate_custom_id",
        message="The custom_id 'a' is already used on line 2.",
        param="custom_id",
    )
    assert len(items) == 2


def test_last_line_without_newline_is_read() -> None:
    data = jsonl(chat_line("a")) + json.dumps(chat_line("b")).encode()
    assert [item.custom_id for item in run(data) if isinstance(item, BatchInputLine)] == ["a", "b"]


@pytest.mark.parametrize("size", [1, 7, 64])
def test_lines_split_across_chunks(size: int) -> None:
    data = jsonl(chat_line("a"), b"", chat_line("b"), b"{oops", chat_line("c"))
    expected = run(data)
    assert list(iter_input_lines(Trickle(data, size))) == expected  # type: ignore[arg-type]
    assert [item.line for item in expected if isinstance(item, LineError)] == [4]


# --- every error code ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json}", "not valid JSON"),
        (b'{"custom_id": "a",}', "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
        (b"null", "must be a JSON object"),
        (b'{"custom_id": "a", "body": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
    ],
)
def test_invalid_json_line(raw: bytes, message: str) -> None:
    error = only_error(jsonl(chat_line("a"), raw, chat_line("b")))
    assert (error.line, error.code, error.param) == (2, "invalid_json_line", None)
    assert message in error.message


def test_invalid_encoding() -> None:
    bad = json.dumps(chat_line("b")).encode().replace(b"Hi", b"H\xff")
    error = only_error(jsonl(chat_line("a"), bad))
    assert (error.line, error.code, error.param) == (2, "invalid_encoding", None)
    # Non-ASCII UTF-8 is fine.
    assert errors(jsonl(chat_line("a", messages=[{"role": "user", "content": "héllo ✓ 你好"}]))) == []


@pytest.mark.parametrize("data", [b"", b"\n", b"  \n\r\n\n"])
def test_empty_file(data: bytes) -> None:
    assert run(data) == [LineError(line=None, code="empty_file", message="The file contains no requests.")]


@pytest.mark.parametrize(
    ("remove", "param"),
    [
        (("custom_id",), "custom_id"),
        (("method",), "method"),
        (("url",), "url"),
        (("body",), "body"),
        (("body", "model"), "body.model"),
        (("body", "messages"), "body.messages"),
    ],
)
def test_missing_required_parameter(remove: tuple[str, ...], param: str) -> None:
    line = chat_line("x")
    target = line if len(remove) == 1 else line["body"]
    del target[remove[-1]]
    error = only_error(jsonl(chat_line("a"), line))
    assert error == LineError(
        line=2, code="missing_required_parameter", message=f"Missing required parameter: '{param}'.", param=param
    )


def test_missing_nested_parameters_name_their_path() -> None:
    messages = [{"role": "system", "content": "x"}, {"content": "y"}]
    assert only_error(jsonl(chat_line(messages=messages))).param == "body.messages[1].role"
    parts = [{"role": "user", "content": [{"type": "text"}]}]
    assert only_error(jsonl(chat_line(messages=parts))).param == "body.messages[0].content[0].text"
    prompt_missing = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"model": "demo"}}
    assert only_error(jsonl(prompt_missing)).param == "body.prompt"
    input_missing = {"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"model": "demo"}}
    assert only_error(jsonl(input_missing)).param == "body.input"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "bot"}]},
            "body.messages[2].role",
        ),
        ({"messages": []}, "body.messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            "body.messages[0].content[0].type",
        ),
        ({"messages": [{"role": "user", "content": 3}]}, "body.messages[0].content"),
        ({"temperature": 2.5}, "body.temperature"),
        ({"top_p": 0}, "body.top_p"),
        ({"top_k": -2}, "body.top_k"),
        ({"max_tokens": 0}, "body.max_tokens"),
        ({"max_completion_tokens": "many"}, "body.max_completion_tokens"),
        ({"n": 0}, "body.n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "body.stop"),
        ({"presence_penalty": 3}, "body.presence_penalty"),
        ({"frequency_penalty": -2.5}, "body.frequency_penalty"),
        ({"top_logprobs": 21, "logprobs": True}, "body.top_logprobs"),
        ({"top_logprobs": 2}, "body.top_logprobs"),
        ({"response_format": {"type": "xml"}}, "body.response_format.type"),
        ({"seed": 1.5}, "body.seed"),
        ({"model": 7}, "body.model"),
        # Numbers that would overflow or exhaust the engine mid-batch are bounded here, by name.
        ({"temperature": 1, "top_k": 9223372036854775808}, "body.top_k"),
        ({"top_k": 2**31}, "body.top_k"),
        ({"seed": 2**63}, "body.seed"),
        ({"seed": -(2**63) - 1}, "body.seed"),
        ({"max_tokens": 2**31}, "body.max_tokens"),
        ({"max_completion_tokens": 2**40}, "body.max_completion_tokens"),
    ],
)
def test_invalid_request_param_is_the_body_path(body: dict[str, Any], param: str) -> None:
    error = only_error(jsonl(chat_line("a"), chat_line("b", **body)))
    assert (error.line, error.code, error.param) == (2, "invalid_request", param)
    assert param in error.message


@pytest.mark.parametrize(
    ("line", "param"),
    [
        ({"custom_id": 5, "method": "POST", "url": CHAT, "body": {}}, "custom_id"),
        ({"custom_id": "", "method": "POST", "url": CHAT, "body": {}}, "custom_id"),
        ({"custom_id": "x", "method": "POST", "url": CHAT, "body": "text"}, "body"),
        ({"custom_id": "x", "method": "POST", "url": CHAT, "body": None}, "body"),
    ],
)
def test_invalid_request_on_the_envelope(line: dict[str, Any], param: str) -> None:
    error = only_error(jsonl(line))
    assert (error.line, error.code, error.param) == (1, "invalid_request", param)


@pytest.mark.parametrize(
    ("url", "key", "value", "problem"),
    [
        ("/v1/completions", "prompt", [], "must not be empty"),
        ("/v1/completions", "prompt", ["a", 1], "only texts"),
        ("/v1/completions", "prompt", [[1], 2], "only texts"),
        ("/v1/completions", "prompt", [1, -1], "non-negative"),
        ("/v1/completions", "prompt", [1, 2**31], "at most 2147483647"),
        ("/v1/completions", "prompt", [[1], [2**63 + 5]], "at most 2147483647"),
        ("/v1/completions", "prompt", [[1], []], "must not be empty"),
        ("/v1/embeddings", "input", [[1, 2], [3, -4]], "non-negative"),
        ("/v1/embeddings", "input", ["a", [1]], "only texts"),
    ],
)
def test_prompts_must_be_homogeneous(url: str, key: str, value: Any, problem: str) -> None:
    line = {"custom_id": "p", "method": "POST", "url": url, "body": {"model": "demo", key: value}}
    error = only_error(jsonl(line))
    assert (error.line, error.code, error.param) == (1, "invalid_request", f"body.{key}")
    assert problem in error.message


def test_invalid_url() -> None:
    bad = chat_line("b") | {"url": "/v1/chat/completion"}
    error = only_error(jsonl(chat_line("a"), bad))
    assert (error.line, error.code, error.param) == (2, "invalid_url", "url")
    assert "'/v1/chat/completion' is not supported" in error.message


def test_url_must_match_the_batch_endpoint() -> None:
    error = only_error(jsonl(chat_line("a")), endpoint="/v1/completions")
    assert (error.line, error.code, error.param) == (1, "invalid_url", "url")
    assert "does not match the batch endpoint '/v1/completions'" in error.message


def test_url_must_match_the_first_line_without_an_endpoint() -> None:
    other = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"model": "demo", "input": "x"}}
    error = only_error(jsonl(chat_line("a"), other))
    assert (error.line, error.code, error.param) == (2, "invalid_url", "url")


def test_unknown_endpoint_argument_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unsupported endpoint"):
        run(jsonl(chat_line()), endpoint="/v1/moderations")


@pytest.mark.parametrize("method", ["GET", "post", ""])
def test_invalid_method(method: str) -> None:
    error = only_error(jsonl(chat_line("a") | {"method": method}))
    assert (error.line, error.code, error.param) == (1, "invalid_method", "method")


def test_duplicate_custom_id_names_the_first_line() -> None:
    error = only_error(jsonl(chat_line("a"), chat_line("b"), chat_line("c"), chat_line("b")))
    assert error == LineError(
        line=4, code="duplicate_custom_id", message="The custom_id 'b' is already used on line 2.", param="custom_id"
    )


def test_duplicate_custom_id_counts_lines_whose_body_is_invalid() -> None:
    error = errors(jsonl(chat_line("a", temperature=9), chat_line("a")))[1]
    assert (error.line, error.code) == (2, "duplicate_custom_id")


def test_mismatched_model_names_the_first_line() -> None:
    error = only_error(jsonl(chat_line("a"), chat_line("b", model="other")))
    assert (error.line, error.code, error.param) == (2, "mismatched_model", "body.model")
    assert "'other' differs from 'demo' used by line 1" in error.message


def test_mismatched_model_against_the_expected_model() -> None:
    error = only_error(jsonl(chat_line("a", model="other")), model="demo")
    assert (error.line, error.code, error.param) == (1, "mismatched_model", "body.model")


@pytest.mark.parametrize(
    ("url", "prompt"), [(CHAT, {"messages": [{"role": "user", "content": "x"}]}), (COMPLETIONS, {"prompt": "x"})]
)
def test_streaming_unsupported(url: str, prompt: dict[str, Any]) -> None:
    body = {"model": "demo", "stream": True, **prompt}
    error = only_error(jsonl({"custom_id": "s", "method": "POST", "url": url, "body": body}))
    assert (error.line, error.code, error.param) == (1, "streaming_unsupported", "body.stream")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temprature": 0.5}, "body.temprature"),
        ({"stream": False, "stream_options": {"include_usage": True, "usage": 1}}, "body.stream_options.usage"),
    ],
)
def test_an_unknown_field_is_named(body: dict[str, Any], param: str) -> None:
    """Not a field of OpenAI's API or vLLM's: a typo is refused, never ignored."""
    error = only_error(jsonl(chat_line("a", **body)))
    assert (error.line, error.code, error.param) == (1, "unknown_parameter", param)
    assert error.message == f"Unrecognized request argument supplied: '{param}'."


@pytest.mark.parametrize(
    ("body", "param", "problem"),
    [
        ({"stream_options": {"include_usage": True}}, "body.stream_options", "only allowed when 'stream' is true"),
        ({"logit_bias": {"abc": 1}}, "body.logit_bias", "keys must be token ids"),
        ({"logit_bias": {"-3": 1}}, "body.logit_bias", "keys must be token ids"),
        ({"logit_bias": {"3": 101}}, "body.logit_bias", "<= 100"),
        ({"min_p": 1.5}, "body.min_p", "<= 1"),
        ({"repetition_penalty": 0}, "body.repetition_penalty", "> 0"),
        ({"min_tokens": -1}, "body.min_tokens", ">= 0"),
        ({"stop_token_ids": [-1]}, "body.stop_token_ids[0]", ">= 0"),
    ],
)
def test_sampling_extensions_are_checked(body: dict[str, Any], param: str, problem: str) -> None:
    error = only_error(jsonl(chat_line("a", **body)))
    assert (error.line, error.code, error.param) == (1, "invalid_request", param)
    assert problem in error.message


def test_too_many_requests_stops_at_the_first_line_over_the_limit() -> None:
    data = jsonl(*(chat_line(str(i)) for i in range(5)))
    items = run(data, limits=ValidationLimits(max_requests=3))
    assert [type(item) for item in items] == [BatchInputLine] * 3 + [LineError]
    last = items[-1]
    assert isinstance(last, LineError)
    assert (last.line, last.code, last.param) == (4, "too_many_requests", None)
    assert "3" in last.message
    exactly_the_limit = run(jsonl(*(chat_line(str(i)) for i in range(3))), limits=ValidationLimits(max_requests=3))
    assert all(isinstance(item, BatchInputLine) for item in exactly_the_limit)


@pytest.mark.parametrize("size", [5, 1 << 20])
def test_line_too_long(size: int) -> None:
    long = chat_line("long", messages=[{"role": "user", "content": "x" * 300}])
    data = jsonl(chat_line("a"), long, chat_line("b"), long | {"custom_id": "c"})
    items = list(iter_input_lines(Trickle(data, size), limits=ValidationLimits(max_line_bytes=200)))  # type: ignore[arg-type]
    assert [(item.line, item.code) for item in items if isinstance(item, LineError)] == [
        (2, "line_too_long"),
        (4, "line_too_long"),
    ]
    assert [item.custom_id for item in items if isinstance(item, BatchInputLine)] == ["a", "b"]


def test_line_too_long_without_a_final_newline() -> None:
    data = jsonl(chat_line("a")) + b"x" * 500
    error = only_error(data, limits=ValidationLimits(max_line_bytes=200))
    assert (error.line, error.code) == (2, "line_too_long")


def test_file_too_large() -> None:
    data = jsonl(*(chat_line(str(i)) for i in range(50)))
    items = run(data, limits=ValidationLimits(max_file_bytes=len(data) - 1))
    assert items[-1] == LineError(
        line=None, code="file_too_large", message=f"The file exceeds the limit of {len(data) - 1} bytes."
    )
    assert run(data, limits=ValidationLimits(max_file_bytes=len(data)))[-1] != items[-1]


# --- the report ----------------------------------------------------------------------------------------------------


def test_report_of_a_valid_file() -> None:
    report = validate_input_file(io.BytesIO(jsonl(chat_line("a"), b"", chat_line("b"))))
    assert report.ok
    assert (report.request_count, report.error_count, report.errors) == (2, 0, [])
    assert (report.model, report.endpoint) == ("demo", CHAT)
    assert report.batch_errors() is None


def test_report_keeps_the_first_errors_and_counts_all() -> None:
    lines = [chat_line(str(i), temperature=5 if i % 2 else 1) for i in range(10)]
    report = validate_input_file(io.BytesIO(jsonl(*lines, b"{")), max_errors=3)
    assert not report.ok
    assert (report.request_count, report.error_count) == (11, 6)
    assert [e.line for e in report.errors] == [2, 4, 6]
    batch_errors = report.batch_errors()
    assert batch_errors is not None
    assert batch_errors.object == "list"
    assert batch_errors.data[0] == BatchError(
        code="invalid_request",
        message=report.errors[0].message,
        param="body.temperature",
        line=2,
    )


def test_report_of_an_empty_file() -> None:
    report = validate_input_file(io.BytesIO(b"\n"))
    assert (report.ok, report.request_count, report.model, report.endpoint) == (False, 0, None, None)
    assert [e.code for e in report.errors] == ["empty_file"]


def test_line_error_maps_one_to_one_onto_batch_error() -> None:
    error = LineError(line=3, code="invalid_request", message="m", param="body.n")
    assert msgspec.structs.asdict(error.to_batch_error()) == msgspec.structs.asdict(error)


# --- the upload-time check -----------------------------------------------------------------------------------------


def feed_in_chunks(data: bytes, size: int, limits: ValidationLimits = DEFAULT_LIMITS) -> LineError | None:
    checker = UploadChecker(limits)
    for start in range(0, len(data), size):
        checker.feed(data[start : start + size])
    return checker.finish()


def test_upload_check_accepts_any_json_objects() -> None:
    data = jsonl(chat_line("a"), {"anything": [1, 2]}, b"", chat_line("a"))  # request errors are not its job
    assert check_upload(io.BytesIO(data)) is None
    assert feed_in_chunks(data, 3) is None


@pytest.mark.parametrize(
    ("data", "line", "code"),
    [
        (jsonl(chat_line(), b"[1]"), 2, "invalid_json_line"),
        (jsonl(b"", chat_line(), b"{"), 3, "invalid_json_line"),
        (jsonl(chat_line(), b'{"a": "\xc3\x28"}'), 2, "invalid_encoding"),
        (b"\n \n", None, "empty_file"),
        (jsonl(*([chat_line()] * 3)), 3, "too_many_requests"),
        (jsonl(chat_line(), chat_line(temperature=0.123456789)), 2, "line_too_long"),
    ],
)
def test_upload_check_reports_the_first_error(data: bytes, line: int | None, code: str) -> None:
    limits = ValidationLimits(max_requests=2, max_line_bytes=len(json.dumps(chat_line())) + 1)
    for error in (check_upload(io.BytesIO(data), limits), feed_in_chunks(data, 4, limits)):
        assert error is not None
        assert (error.line, error.code) == (line, code)
    limits_only = code in ("too_many_requests", "line_too_long")
    assert (check_upload(io.BytesIO(data)) is None) == limits_only


def test_upload_check_error_is_sticky() -> None:
    checker = UploadChecker()
    first = checker.feed(b"{bad}\n")
    assert first is not None and first.line == 1
    assert checker.feed(jsonl(chat_line())) is first
    assert checker.finish() is first
