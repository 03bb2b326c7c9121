"""Metadata limits, filename sanitizing and id validation: each refusal names its code and param."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.server.security.limits import (
    DEFAULT_FILENAME,
    MAX_FILENAME_BYTES,
    LimitError,
    is_valid_id,
    sanitize_filename,
    validate_metadata,
)
from batchgen.server.storage.blobs import BlobStore


def test_metadata_within_limits_passes_through() -> None:
    metadata = {f"k{i}": "v" * 512 for i in range(15)} | {"x" * 64: ""}
    assert validate_metadata(metadata) == metadata
    assert validate_metadata(None) is None
    assert validate_metadata({}) == {}


@pytest.mark.parametrize(
    ("metadata", "fragment"),
    [
        ({f"k{i}": "v" for i in range(17)}, "has 17 keys; at most 16 are allowed"),
        ({"x" * 65: "v"}, "has 65 characters; at most 64 are allowed"),
        ({"key": "v" * 513}, "value of key 'key' has 513 characters; at most 512 are allowed"),
        ({"key": 5}, "got int for key 'key'"),
        ({"key": None}, "got NoneType"),
        ({"key": {"nested": "v"}}, "got dict"),
        ({3: "v"}, "must be strings"),
        (["not", "a", "mapping"], "must be an object"),
    ],
)
def test_metadata_over_limits_is_refused(metadata: object, fragment: str) -> None:
    with pytest.raises(LimitError) as raised:
        validate_metadata(metadata)
    error = raised.value
    assert (error.status_code, error.param, error.code) == (400, "metadata", "invalid_value")
    assert fragment in error.message


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


def test_ids_as_the_server_makes_them_are_valid() -> None:
    assert is_valid_id("file-0123456789abcdef01234567", "file")
    assert is_valid_id("batch_" + "f" * 64, "batch")


@pytest.mark.parametrize(
    ("bad", "kind"),
    [
        ("", "file"),
        ("file-", "file"),
        ("file-../../etc/passwd", "file"),
        ("file-abc/def", "file"),
        ("file-ABC", "file"),
        ("file-abc\x00", "file"),
        ("file-abc\n", "file"),
        ("file_abc", "file"),
        ("batch_abc", "file"),
        ("file-" + "a" * 65, "file"),
        ("file-%2e%2e", "file"),
        (" file-abc", "file"),
        ("batch-abc", "batch"),
        ("file-abc", "batch"),
        ("batch_..", "batch"),
        ("batch_abc/cancel", "batch"),
        ("batch_xyz", "batch"),
    ],
)
def test_anything_else_is_not_an_id(bad: str, kind: Literal["file", "batch"], tmp_path: Path) -> None:
    assert not is_valid_id(bad, kind)
    if kind == "file":  # nor does the blob store build a path from it
        with pytest.raises(ValueError, match="not a file id"):
            BlobStore(tmp_path).path(bad)
