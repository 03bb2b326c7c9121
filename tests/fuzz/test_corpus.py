"""Every malformed file of the corpus gets exactly its documented errors (code, line, param), at upload and in full.

``corpus/EXPECTED.json`` documents, per file, why it is malformed and the errors a batch created from it reports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchgen.schemas.validation import ValidationLimits, check_upload, validate_input_file

CORPUS = Path(__file__).parent / "corpus"
EXPECTED: dict[str, dict[str, Any]] = json.loads((CORPUS / "EXPECTED.json").read_text())
# The documented error codes of the input validator; the corpus must exercise each one.
DOCUMENTED_CODES = {
    "empty_file",
    "file_too_large",
    "too_many_requests",
    "line_too_long",
    "invalid_encoding",
    "invalid_json_line",
    "missing_required_parameter",
    "invalid_request",
    "invalid_method",
    "invalid_url",
    "duplicate_custom_id",
    "mismatched_model",
    "streaming_unsupported",
}
# What the cheap upload-time check catches: file-level limits, encoding, one JSON object per line.
UPLOAD_CODES = {
    "empty_file",
    "file_too_large",
    "too_many_requests",
    "line_too_long",
    "invalid_encoding",
    "invalid_json_line",
}


def test_the_corpus_is_complete() -> None:
    files = {path.name for path in CORPUS.glob("*.jsonl")}
    assert files == set(EXPECTED)
    assert len(files) >= 40
    assert {error["code"] for spec in EXPECTED.values() for error in spec["errors"]} == DOCUMENTED_CODES
    assert all(spec["doc"] and spec["errors"] for spec in EXPECTED.values())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_file_gets_its_documented_errors(name: str) -> None:
    spec = EXPECTED[name]
    limits = ValidationLimits(**spec["limits"])
    report = validate_input_file(CORPUS / name, endpoint=spec["endpoint"], model=spec["model"], limits=limits)
    found = [{"line": e.line, "code": e.code, "param": e.param} for e in report.errors]
    assert found == spec["errors"], spec["doc"]
    assert report.error_count == len(spec["errors"])
    assert all(e.message for e in report.errors)
    assert spec.get("message_contains", "") in report.errors[0].message
    assert not report.ok
    assert report.batch_errors() is not None


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_upload_check_stops_at_the_first_upload_level_error(name: str) -> None:
    spec = EXPECTED[name]
    error = check_upload(CORPUS / name, ValidationLimits(**spec["limits"]))
    upload_level = [e for e in spec["errors"] if e["code"] in UPLOAD_CODES]
    if upload_level:
        assert error is not None, spec["doc"]
        assert {"line": error.line, "code": error.code, "param": error.param} == upload_level[0]
    else:
        assert error is None, f"{name}: the upload check is for encoding and JSON only, got {error}"
