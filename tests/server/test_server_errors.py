"""Bad input, table-driven: every error is ``{"error": {message, type, param, code}}`` with the right status."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import LiveServer, chat_line, jsonl


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    status: int
    code: str
    param: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


def upload(content: bytes, **form: str) -> dict[str, Any]:
    return {"data": {"purpose": "batch", **form}, "files": {"file": ("in.jsonl", content)}}


GOOD = jsonl([chat_line("a")])
CASES = [
    Case("unknown file", "GET", "/v1/files/file-000000000000000000000000", 404, "file_not_found"),
    Case("unknown file content", "GET", "/v1/files/file-nope/content", 404, "file_not_found"),
    Case("delete unknown file", "DELETE", "/v1/files/file-nope", 404, "file_not_found"),
    Case("unknown batch", "GET", "/v1/batches/batch_nope", 404, "batch_not_found"),
    Case("cancel unknown batch", "POST", "/v1/batches/batch_nope/cancel", 404, "batch_not_found"),
    Case("unknown model", "GET", "/v1/models/gpt-4o", 404, "model_not_found", "model"),
    Case("unknown route", "GET", "/v1/nothing-here", 404, "not_found"),
    Case("wrong method", "DELETE", "/v1/models", 405, "method_not_allowed"),
    Case("upload as json", "POST", "/v1/files", 415, "invalid_content_type", kwargs={"json": {"purpose": "batch"}}),
    Case(
        "upload without purpose",
        "POST",
        "/v1/files",
        400,
        "missing_required_parameter",
        "purpose",
        {"files": {"file": ("in.jsonl", GOOD)}},
    ),
    Case(
        "upload without file",
        "POST",
        "/v1/files",
        400,
        "missing_required_parameter",
        "file",
        {"files": {"purpose": (None, "batch")}},
    ),
    Case("upload other purpose", "POST", "/v1/files", 400, "invalid_value", "purpose", upload(GOOD, purpose="tune")),
    Case("upload bad json line", "POST", "/v1/files", 422, "invalid_json_line", "file", upload(GOOD + b"{oops\n")),
    Case("upload not utf-8", "POST", "/v1/files", 422, "invalid_encoding", "file", upload(b'{"a": "\xff\xfe"}\n')),
    Case("upload empty file", "POST", "/v1/files", 422, "empty_file", "file", upload(b"\n\n")),
    Case("upload line not an object", "POST", "/v1/files", 422, "invalid_json_line", "file", upload(b"[1, 2]\n")),
    Case(
        "upload bad expiry anchor",
        "POST",
        "/v1/files",
        400,
        "invalid_value",
        "expires_after[anchor]",
        upload(GOOD, **{"expires_after[anchor]": "now", "expires_after[seconds]": "3600"}),
    ),
    Case(
        "upload expiry too short",
        "POST",
        "/v1/files",
        400,
        "invalid_value",
        "expires_after[seconds]",
        upload(GOOD, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}),
    ),
    Case(
        "batch body not json",
        "POST",
        "/v1/batches",
        400,
        "invalid_json",
        kwargs={"content": b"{nope", "headers": {"content-type": "application/json"}},
    ),
    Case(
        "batch without input file",
        "POST",
        "/v1/batches",
        400,
        "missing_required_parameter",
        "input_file_id",
        {"json": {"endpoint": "/v1/chat/completions"}},
    ),
    Case(
        "batch unknown field",
        "POST",
        "/v1/batches",
        400,
        "unknown_parameter",
        "max_tokens",
        {"json": {"input_file_id": "file-x", "max_tokens": 5}},
    ),
    Case(
        "batch window too short",
        "POST",
        "/v1/batches",
        400,
        "invalid_value",
        "completion_window",
        {"json": {"input_file_id": "file-x", "completion_window": "12h"}},
    ),
    Case(
        "batch window too long",
        "POST",
        "/v1/batches",
        400,
        "invalid_value",
        "completion_window",
        {"json": {"input_file_id": "file-x", "completion_window": "15d"}},
    ),
    Case(
        "batch window not a duration",
        "POST",
        "/v1/batches",
        400,
        "invalid_value",
        "completion_window",
        {"json": {"input_file_id": "file-x", "completion_window": "soon"}},
    ),
    Case(
        "batch bad endpoint",
        "POST",
        "/v1/batches",
        400,
        "invalid_value",
        "endpoint",
        {"json": {"input_file_id": "file-x", "endpoint": "/v1/images"}},
    ),
    Case(
        "batch unknown input file",
        "POST",
        "/v1/batches",
        404,
        "file_not_found",
        kwargs={"json": {"input_file_id": "file-000000000000000000000000"}},
    ),
    Case(
        "batch temperature out of range",
        "POST",
        "/v1/batches",
        400,
        "invalid_value",
        "temperature",
        {"json": {"input_file_id": "file-x", "temperature": 3}},
    ),
    Case(
        "batch zero max_decoding_length",
        "POST",
        "/v1/batches",
        400,
        "invalid_value",
        "max_decoding_length",
        {"json": {"input_file_id": "file-x", "max_decoding_length": 0}},
    ),
    Case(
        "batch max_context_length over the model",
        "POST",
        "/v1/batches",
        400,
        "invalid_value",
        "max_context_length",
        {"json": {"input_file_id": "file-x", "max_context_length": 1_000_000}},
    ),
    Case(
        "batch max_decoding_length over the model",
        "POST",
        "/v1/batches",
        400,
        "invalid_value",
        "max_decoding_length",
        {"json": {"input_file_id": "file-x", "max_decoding_length": 10**23}},
    ),
    Case(
        "batch huge top_k",
        "POST",
        "/v1/batches",
        400,
        "invalid_value",
        "top_k",
        {"json": {"input_file_id": "file-x", "top_k": 10**23}},
    ),
    Case(
        "batch too much metadata",
        "POST",
        "/v1/batches",
        400,
        "invalid_value",
        "metadata",
        {"json": {"input_file_id": "file-x", "metadata": {f"k{i}": "v" for i in range(17)}}},
    ),
    Case(
        "batch metadata not strings",
        "POST",
        "/v1/batches",
        400,
        "invalid_value",
        "metadata",
        {"json": {"input_file_id": "file-x", "metadata": {"k": 1}}},
    ),
    Case("files limit 0", "GET", "/v1/files", 400, "invalid_value", "limit", {"params": {"limit": 0}}),
    Case("files limit too big", "GET", "/v1/files", 400, "invalid_value", "limit", {"params": {"limit": 10001}}),
    Case("files bad order", "GET", "/v1/files", 400, "invalid_value", "order", {"params": {"order": "sideways"}}),
    Case("batches limit too big", "GET", "/v1/batches", 400, "invalid_value", "limit", {"params": {"limit": 101}}),
    Case("batches limit not a number", "GET", "/v1/batches", 400, "invalid_value", "limit", {"params": {"limit": "x"}}),
    Case("legacy inference", "POST", "/v1/inference", 410, "endpoint_removed", kwargs={"json": {"prompt": "hi"}}),
    Case(
        "idempotency key too long",
        "POST",
        "/v1/batches",
        400,
        "invalid_value",
        "Idempotency-Key",
        {"json": {"input_file_id": "file-x"}, "headers": {"Idempotency-Key": "k" * 300}},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_gets_a_clear_error(live_server: LiveServer, case: Case) -> None:
    response = live_server.http.request(case.method, case.path, **case.kwargs)
    assert response.status_code == case.status, response.text
    assert response.headers["x-request-id"]
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert (error["code"], error["param"]) == (case.code, case.param), error
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    expected_type = "server_error" if case.status >= 500 else "invalid_request_error"
    assert error["type"] == expected_type


def test_upload_check_names_the_line(live_server: LiveServer) -> None:
    content = jsonl([chat_line("a"), chat_line("b")]) + b"not json\n"
    response = live_server.http.post("/v1/files", **upload(content))  # type: ignore[arg-type]
    assert response.status_code == 422
    assert "line 3" in response.json()["error"]["message"]


def test_batch_from_output_file_is_refused(live_server: LiveServer) -> None:
    batch = live_server.run([chat_line("a")])
    response = live_server.http.post("/v1/batches", json={"input_file_id": batch["output_file_id"]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input_file_id"


def test_cancel_finished_batch_conflicts(live_server: LiveServer) -> None:
    batch = live_server.run([chat_line("a")])
    response = live_server.http.post(f"/v1/batches/{batch['id']}/cancel")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "batch_not_cancellable"
    assert live_server.batch(batch["id"])["status"] == "completed"


def test_request_id_is_echoed_when_sane(live_server: LiveServer) -> None:
    assert live_server.http.get("/health", headers={"x-request-id": "abc-123"}).headers["x-request-id"] == "abc-123"
    generated = live_server.http.get("/health", headers={"x-request-id": "bad id\twith tab"}).headers["x-request-id"]
    assert generated.startswith("req_")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
INTS = st.integers() | st.sampled_from([2**63, 10**30, -(2**63) - 1])  # also past SQLite's 64-bit integers
# Each field is mostly well-typed (so the request gets deep into the server) and sometimes any JSON at all.
BATCH_BODIES = st.fixed_dictionaries(
    {},
    optional={
        name: st.one_of(values, values, values, JSON_VALUES)
        for name, values in {
            "endpoint": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
            "completion_window": st.sampled_from(["24h", "7d", "336h"]),
            "metadata": st.dictionaries(st.text(max_size=70), st.text(max_size=600), max_size=17),
            "max_decoding_length": INTS,
            "max_context_length": INTS,
            "temperature": st.floats(0, 2),
            "top_p": st.floats(0.01, 1),
            "top_k": INTS,
        }.items()
    },
)


@pytest.fixture(scope="module")
def input_file_id(live_server: LiveServer) -> str:
    return str(live_server.upload([chat_line("fuzz", max_tokens=1)])["id"])


@settings(max_examples=150, deadline=None)
@given(body=BATCH_BODIES | JSON_VALUES, real_file=st.booleans())
def test_no_body_makes_the_server_fail(live_server: LiveServer, input_file_id: str, body: Any, real_file: bool) -> None:
    if real_file and isinstance(body, dict):  # get past the file lookup to the insert
        body = {**body, "input_file_id": input_file_id}
    response = live_server.http.post("/v1/batches", json=body)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=60, deadline=None)
@given(
    params=st.dictionaries(st.sampled_from(["limit", "order", "after", "purpose"]), st.text(max_size=12), max_size=4)
)
def test_no_query_makes_the_server_fail(live_server: LiveServer, params: dict[str, str]) -> None:
    for path in ("/v1/files", "/v1/batches"):
        assert live_server.http.get(path, params=params).status_code < 500


@pytest.mark.parametrize("field", ["max_decoding_length", "max_context_length", "top_k"])
@pytest.mark.parametrize("value", [2**63, 10**23])
def test_huge_integers_are_refused(live_server: LiveServer, input_file_id: str, field: str, value: int) -> None:
    response = live_server.http.post("/v1/batches", json={"input_file_id": input_file_id, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


JSON_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/batches"]


@pytest.mark.parametrize("path", JSON_ROUTES)
@pytest.mark.parametrize("depth", [100, 1000, 100_000])
def test_json_nested_past_any_limit_is_refused(live_server: LiveServer, path: str, depth: int) -> None:
    nested = "[" * depth + "]" * depth
    for body in (nested, '{"model": "demo", "input": ' + nested + ', "metadata": {"a": ' + nested + "}}"):
        response = live_server.http.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"]
