"""Encode -> decode round trips of every wire type, and reading output/error file lines with parse_output_line."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from batchgen.schemas import (
    BatchInputLine,
    BatchLineError,
    BatchList,
    BatchOutputLine,
    BatchResponse,
    ChatCompletion,
    CompletionRequest,
    CreateBatchRequest,
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    ErrorDetail,
    ErrorResponse,
    FileDeleted,
    FileList,
    HealthStatus,
    ModelList,
    PoolStatus,
    TextCompletion,
    parse_output_line,
)
from batchgen.schemas.validation import iter_input_lines

from .test_wire_exactness import (
    embedding_list,
    full_batch,
    full_chat_completion,
    full_chat_request,
    full_file,
    full_model,
    full_text_completion,
    minimal_batch,
    minimal_chat_completion,
    minimal_file,
    minimal_text_completion,
)

OBJECTS: list[Callable[[], msgspec.Struct]] = [
    full_batch,
    minimal_batch,
    lambda: BatchList(data=[full_batch(), minimal_batch()], first_id="batch_1", last_id="batch_2", has_more=True),
    full_file,
    minimal_file,
    lambda: FileList(data=[full_file()], first_id="file-1", last_id="file-1"),
    lambda: FileDeleted(id="file-1", deleted=True),
    lambda: ModelList(data=[full_model()]),
    full_chat_completion,
    minimal_chat_completion,
    full_text_completion,
    minimal_text_completion,
    embedding_list,
    lambda: EmbeddingList(
        data=[Embedding(index=0, embedding="AACAPw==")],
        model="demo",
        usage=EmbeddingUsage(prompt_tokens=1, total_tokens=1),
    ),
    lambda: ErrorResponse(error=ErrorDetail(message="m", type="invalid_request_error", param="p", code="c")),
    lambda: HealthStatus(status="healthy", model="demo"),
    lambda: HealthStatus(status="unhealthy", reason="engine stopped"),
    lambda: PoolStatus(
        queued_requests=3,
        running_requests=2,
        capacity=100,
        active_batches=1,
        kv_blocks_total=64,
        kv_blocks_free=10,
        prompt_tokens=1200,
        generated_tokens=345,
    ),
    full_chat_request,
    lambda: CompletionRequest(model="demo", prompt=[[1, 2], [3]], stop=["\n"]),
    lambda: EmbeddingRequest(model="demo", input=[1, 2]),
    lambda: CreateBatchRequest(input_file_id="file-1", endpoint="/v1/embeddings", completion_window="7d", top_k=3),
]


@pytest.mark.parametrize("build", OBJECTS)
def test_round_trip(build: Callable[[], msgspec.Struct]) -> None:
    original = build()
    encoded = msgspec.json.encode(original)
    decoded = msgspec.json.decode(encoded, type=type(original))
    assert decoded == original
    assert msgspec.json.encode(decoded) == encoded


def test_input_lines_round_trip_through_the_validator() -> None:
    """Input lines have an untagged body union, so the validator (which picks the body type by url) decodes them."""
    lines = [
        BatchInputLine(
            custom_id="r1", method="POST", url="/v1/completions", body=CompletionRequest(model="demo", prompt="a")
        ),
        BatchInputLine(
            custom_id="r2", method="POST", url="/v1/completions", body=CompletionRequest(model="demo", prompt=[1])
        ),
    ]
    data = b"\n".join(msgspec.json.encode(line) for line in lines)
    assert list(iter_input_lines(io.BytesIO(data))) == lines
    chat = BatchInputLine(custom_id="c", method="POST", url="/v1/chat/completions", body=full_chat_request())
    assert list(iter_input_lines(io.BytesIO(msgspec.json.encode(chat)))) == [chat]


def test_body_structs_refuse_unknown_fields_and_omit_unset_ones() -> None:
    with pytest.raises(msgspec.ValidationError, match="unknown field `future_field`"):
        msgspec.json.decode(b'{"model": "demo", "input": "x", "future_field": {"a": 1}}', type=EmbeddingRequest)
    request = msgspec.json.decode(b'{"model": "demo", "input": "x", "user": null}', type=EmbeddingRequest)
    assert msgspec.json.decode(msgspec.json.encode(request)) == {"model": "demo", "input": "x"}


def test_create_batch_request_rejects_unknown_fields() -> None:
    with pytest.raises(msgspec.ValidationError, match="unknown field `max_tokens`"):
        msgspec.json.decode(b'{"input_file_id": "file-1", "max_tokens": 5}', type=CreateBatchRequest)


# --- output and error file lines -----------------------------------------------------------------------------------


def success_line(body: ChatCompletion | TextCompletion | EmbeddingList) -> BatchOutputLine:
    return BatchOutputLine(
        id="batch_req_1",
        custom_id="r1",
        response=BatchResponse(status_code=200, request_id="req_1", body=body),
        error=None,
    )


@pytest.mark.parametrize("body", [full_chat_completion, minimal_text_completion, full_text_completion, embedding_list])
def test_parse_success_lines(body: Callable[[], ChatCompletion | TextCompletion | EmbeddingList]) -> None:
    line = success_line(body())
    encoded = msgspec.json.encode(line)
    assert parse_output_line(encoded) == line
    assert parse_output_line(encoded.decode()) == line  # str input too
    sent = msgspec.json.decode(encoded)
    assert list(sent) == ["id", "custom_id", "response", "error"] and sent["error"] is None


def test_parse_a_request_that_the_server_rejected() -> None:
    error = ErrorResponse(
        error=ErrorDetail(
            message="The prompt is longer than the context.", type="invalid_request_error", param="messages",
            code="context_length_exceeded",
        )
    )  # fmt: skip
    line = BatchOutputLine(
        id="batch_req_2",
        custom_id="r2",
        response=BatchResponse(status_code=400, request_id="req_2", body=error),
        error=None,
    )
    parsed = parse_output_line(msgspec.json.encode(line))
    assert parsed == line
    assert parsed.response is not None and isinstance(parsed.response.body, ErrorResponse)


def test_parse_an_error_line_without_response() -> None:
    line = BatchOutputLine(
        id="batch_req_3",
        custom_id="r3",
        response=None,
        error=BatchLineError(code="batch_expired", message="This request could not be executed before expiry."),
    )
    encoded = msgspec.json.encode(line)
    assert msgspec.json.decode(encoded)["response"] is None
    assert parse_output_line(encoded) == line


def test_parse_an_openai_style_line_with_keys_omitted() -> None:
    raw = b'{"id": "x", "custom_id": "c", "error": {"code": "server_error", "message": "boom"}}'
    parsed = parse_output_line(raw)
    assert parsed.response is None and parsed.error == BatchLineError(code="server_error", message="boom")


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b'{"id": "x"}',
        b'{"id": "x", "custom_id": "c", "response": {"status_code": 200, "request_id": "r", "body": {"object": "?"}}}',
        b'{"id": "x", "custom_id": "c", "response": {"status_code": 500, "request_id": "r", "body": {}}}',
    ],
)
def test_parse_rejects_malformed_lines(raw: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        parse_output_line(raw)


def test_response_bodies_are_told_apart_by_their_object_tag() -> None:
    sent: dict[str, Any] = msgspec.to_builtins(success_line(embedding_list()))
    assert sent["response"]["body"]["object"] == "list"
    assert [item["object"] for item in sent["response"]["body"]["data"]] == ["embedding", "embedding"]
    chat = msgspec.to_builtins(full_chat_completion())
    assert chat["object"] == "chat.completion"
    assert msgspec.to_builtins(full_text_completion())["object"] == "text_completion"
