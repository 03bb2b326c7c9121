"""``batchgen-server run-batch`` end to end on a small file, through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchgen.schemas import ChatCompletion, EmbeddingList, ErrorResponse, TextCompletion, parse_output_line
from batchgen.server.cli import main

LINES: list[Any] = [
    {
        "custom_id": "chat",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "n": 2},
    },
    {
        "custom_id": "completion",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "demo", "prompt": ["x", "y"], "max_tokens": 3, "ignore_eos": True},
    },
    {"custom_id": "embedding", "method": "POST", "url": "/v1/embeddings", "body": {"model": "demo", "input": "hello"}},
    {
        "custom_id": "too-long",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "demo", "prompt": "z" * 300},
    },
    {
        "custom_id": "echo",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "demo", "prompt": "x", "echo": True},
    },
    "this line is not JSON",
]


def _write_input(path: Path, count: int = 1) -> None:
    with path.open("w") as f:
        for copy in range(count):
            for line in LINES:
                if isinstance(line, dict):
                    line = json.dumps({**line, "custom_id": f"{line['custom_id']}-{copy}"})
                f.write(line + "\n\n")


def test_run_batch_writes_output_and_error_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, output, errors = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    _write_input(source, count=3)
    argv = ["run-batch", "-i", str(source), "-o", str(output), "--errors-output", str(errors)]
    argv += ["--max-decoding-length", "6", "--max-model-len", "256", "--dtype", "float32", "--max-num-seqs", "4"]
    assert main(argv) == 0
    good = [parse_output_line(line) for line in output.read_text().splitlines()]
    bad = [parse_output_line(line) for line in errors.read_text().splitlines()]
    assert len(good) == 9 and len(bad) == 9
    by_id = {line.custom_id: line for line in good + bad}
    for copy in range(3):
        chat = by_id[f"chat-{copy}"].response.body
        assert isinstance(chat, ChatCompletion) and len(chat.choices) == 2
        assert all(choice.finish_reason in ("stop", "length") for choice in chat.choices)
        assert chat.usage.completion_tokens <= 12  # the batch-level max_decoding_length applies
        completion = by_id[f"completion-{copy}"].response.body
        assert isinstance(completion, TextCompletion) and completion.usage.completion_tokens == 6
        assert isinstance(by_id[f"embedding-{copy}"].response.body, EmbeddingList)
        for custom_id, code in (("too-long", "context_length_exceeded"), ("echo", "unsupported_parameter")):
            line = by_id[f"{custom_id}-{copy}"]
            assert line.response.status_code == 400 and isinstance(line.response.body, ErrorResponse)
            assert line.response.body.error.code == code
    assert [line.response.body.error.code for line in bad if line.custom_id == ""] == ["invalid_json"] * 3
    assert "9/18 completed, 9 failed" in capsys.readouterr().err


def test_run_batch_without_errors_output_puts_everything_in_one_file(tmp_path: Path) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(source)
    assert main(["run-batch", "-i", str(source), "-o", str(output), "--max-decoding-length", "4", "--no-progress"]) == 0
    assert len(output.read_text().splitlines()) == len(LINES)
