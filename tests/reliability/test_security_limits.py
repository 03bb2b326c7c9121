"""Metadata limits, filename sanitizing and id validation: each refusal names its code and param."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.server.security.limits import (
    DEFAULT_FILENAME,
    MAX_FILENAME_BYTES,
    LimitError,
    sanitize_filename,
    validate_batch_id,
    validate_file_id,
    validate_metadata,
)


def test_metadata_within_limits_passes_through() -> None:
    metadata = {f"k{i}": "v" * 512 for i in range(15)} | {"x" * 64: ""}
    assert validate_metadata(metadata) == metadata
    assert validate_metadata(None) is None
    assert validate_metadata({}) == {}


@pytest.mark.parametrize(
    ("metadata", "code", "fragment"),
    [
        ({f"k{i}": "v" for i in range(17)}, "object_above_max_properties", "17 keys; at most 16"),
        ({"x" * 65: "v"}, "string_above_max_length", "65 characters; at most 64"),
        ({"key": "v" * 513}, "string_above_max_length", "513 characters; at most 512"),
        ({"key": 5}, "invalid_type", "got int for key 'key'"),
        ({"key": None}, "invalid_type", "got NoneType"),
        ({"key": {"nested": "v"}}, "invalid_type", "got dict"),
        ({3: "v"}, "invalid_type", "must be strings"),
        (["not", "a", "mapping"], "invalid_type", "must be an object"),
    ],
)
def test_metadata_over_limits_is_refused(metadata: object, code: str, fragment: str) -> None:
    with pytest.raises(LimitError) as raised:
        validate_metadata(metadata)
    error = raised.value
    assert (error.status_code, error.type, error.param, error.code) == (400, "invalid_request_error", "metadata", code)
    assert fragment in error.message
    detail = error.to_response().error
    assert (detail.message, detail.type, detail.param, detail.code) == (error.message, error.type, "metadata", code)


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("requests.jsonl", "requests.jsonl"),
        ("../../etc/passwd", "passwd"),
        ("/abs/dir/in.jsonl", "in.jsonl"),
        ("C:\\Users\\me\\in.jsonl", "in.jsonl"),
        ("..", DEFAULT_FILENAME),
        ("dir/", DEFAULT_FILENAME),
        ("", DEFAULT_FILENAME),
        (None, DEFAULT_FILENAME),
        (".hidden.jsonl", "hidden.jsonl"),
        ("in\x00put\r\n.jsonl", "input.jsonl"),
        ("\x1b[31mred\x1b[0m.jsonl", "[31mred[0m.jsonl"),
        ("evil\u202egnp.jsonl", "evilgnp.jsonl"),
        ('say "hi".jsonl', "say hi.jsonl"),
        ("données été.jsonl", "données été.jsonl"),
        ("  spaced  .jsonl ", "spaced  .jsonl"),
    ],
)
def test_filenames_are_sanitized(raw: str | None, clean: str) -> None:
    assert sanitize_filename(raw) == clean


def test_long_filenames_keep_their_extension_and_fit_in_255_bytes() -> None:
    assert sanitize_filename("a" * 1000 + ".jsonl") == "a" * 249 + ".jsonl"
    multibyte = sanitize_filename("é" * 300 + ".jsonl")
    assert multibyte.endswith(".jsonl")
    assert len(multibyte.encode()) <= MAX_FILENAME_BYTES
    assert set(multibyte.removesuffix(".jsonl")) == {"é"}
    assert len(sanitize_filename("b" * 400).encode()) == MAX_FILENAME_BYTES


@given(st.text())
def test_any_name_sanitizes_to_a_safe_one(raw: str) -> None:
    name = sanitize_filename(raw)
    assert name
    assert "/" not in name and "\\" not in name and '"' not in name
    assert not name.startswith(".")
    assert len(name.encode()) <= MAX_FILENAME_BYTES
    assert all(ch.isprintable() or ch == " " for ch in name if ord(ch) < 0x80)


def test_well_formed_ids_pass() -> None:
    assert validate_file_id("file-0123456789abcdef") == "file-0123456789abcdef"
    assert validate_batch_id("batch_" + "f" * 64) == "batch_" + "f" * 64


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "file-",
        "file-../../etc/passwd",
        "file-abc/def",
        "file-ABC",
        "file-abc\x00",
        "file-abc\n",
        "file_abc",
        "batch_abc",
        "file-" + "a" * 65,
        "file-%2e%2e",
        " file-abc",
    ],
)
def test_malformed_file_ids_are_refused(bad: str) -> None:
    with pytest.raises(LimitError) as raised:
        validate_file_id(bad, param="input_file_id")
    assert (raised.value.param, raised.value.code, raised.value.status_code) == ("input_file_id", "invalid_id", 400)
    assert "expected 'file-' followed by" in raised.value.message


@pytest.mark.parametrize("bad", ["batch-abc", "file-abc", "batch_..", "batch_abc/cancel", "batch_xyz"])
def test_malformed_batch_ids_are_refused(bad: str) -> None:
    with pytest.raises(LimitError, match="expected 'batch_' followed by") as raised:
        validate_batch_id(bad)
    assert raised.value.param == "batch_id"


def test_refusal_messages_of_huge_ids_stay_short() -> None:
    with pytest.raises(LimitError) as raised:
        validate_file_id("x" * 100_000)
    assert len(raised.value.message) < 200
