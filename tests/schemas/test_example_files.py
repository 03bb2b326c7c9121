"""The example input files in examples/ stay valid, and bad_requests.jsonl shows the errors docs/schemas.md lists."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen.schemas import BatchInputLine, EmbeddingRequest
from batchgen.schemas.validation import LineError, iter_input_lines, validate_input_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("name", "endpoint"),
    [
        ("chat", "/v1/chat/completions"),
        ("completions", "/v1/completions"),
        ("embeddings", "/v1/embeddings"),
        ("extraction", "/v1/chat/completions"),
    ],
)
def test_examples_are_valid(name: str, endpoint: str) -> None:
    report = validate_input_file(EXAMPLES / f"{name}.jsonl", endpoint=endpoint, model="demo")
    assert report.ok, report.errors
    assert report.request_count >= 4
    for line in iter_input_lines(EXAMPLES / f"{name}.jsonl"):
        assert isinstance(line, BatchInputLine)
        if not isinstance(line.body, EmbeddingRequest):  # short generations: the demo model is slow for its size
            limit = line.body.max_tokens or getattr(line.body, "max_completion_tokens", None)
            # JSON from a random model: up to 20 spaces of whitespace at each of its places
            assert limit is not None and limit <= (256 if name == "extraction" else 32)


def test_bad_requests_show_the_documented_errors() -> None:
    errors = [item for item in iter_input_lines(EXAMPLES / "bad_requests.jsonl") if isinstance(item, LineError)]
    assert [(e.line, e.code, e.param) for e in errors] == [
        (2, "invalid_json_line", None),
        (3, "invalid_request", "body.messages[1].role"),
        (4, "missing_required_parameter", "body.messages"),
        (5, "invalid_request", "body.temperature"),
        (6, "duplicate_custom_id", "custom_id"),
        (7, "invalid_url", "url"),
        (8, "invalid_method", "method"),
        (9, "mismatched_model", "body.model"),
        (10, "streaming_unsupported", "body.stream"),
    ]
