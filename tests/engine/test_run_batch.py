"""``batchgen-server run-batch`` end to end on small files, through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchgen.schemas import ChatCompletion, EmbeddingList, ErrorResponse, TextCompletion, parse_output_line
from batchgen.server.cli import main

ENGINE_FLAGS = ["--max-model-len", "256", "--num-kv-blocks", "256", "--max-num-seqs", "4", "--no-progress"]


def _write(path: Path, url: str, bodies: dict[str, dict[str, Any]], copies: int = 1) -> None:
    with path.open("w") as f:
        for copy in range(copies):
            for custom_id, body in bodies.items():
                line = {
                    "custom_id": f"{custom_id}-{copy}",
                    "method": "POST",
                    "url": url,
                    "body": {"model": "demo", **body},
                }
                f.write(json.dumps(line) + "\n\n")  # blank lines are skipped


def _read(path: Path) -> dict[str, Any]:
    return {line.custom_id: line for line in map(parse_output_line, path.read_text().splitlines())}


def test_completions_file_with_per_request_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, output, errors = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    bodies = {
        "ok": {"prompt": ["x", "y"], "n": 2, "ignore_eos": True},
        "too-long": {"prompt": "z" * 300},
        "suffix": {"prompt": "x", "suffix": "y"},
    }
    _write(source, "/v1/completions", bodies, copies=3)
    argv = ["run-batch", "-i", str(source), "-o", str(output), "--errors-output", str(errors)]
    assert main([*argv, "--max-decoding-length", "6", *ENGINE_FLAGS]) == 0
    good, bad = _read(output), _read(errors)
    assert sorted(good) == ["ok-0", "ok-1", "ok-2"]
    for line in good.values():
        body = line.response.body
        assert line.response.status_code == 200 and isinstance(body, TextCompletion)
        assert [c.index for c in body.choices] == [0, 1, 2, 3]
        assert body.usage.completion_tokens == 24  # 2 prompts x 2 choices x the batch's max_decoding_length
    assert len(bad) == 6
    for custom_id, line in bad.items():
        assert line.response.status_code == 400 and isinstance(line.response.body, ErrorResponse)
        expected = "context_length_exceeded" if custom_id.startswith("too-long") else "unsupported_parameter"
        assert line.response.body.error.code == expected
    assert "3/9 completed, 6 failed" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "body", "body_type"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}, ChatCompletion),
        ("/v1/embeddings", {"input": ["hello", "world"]}, EmbeddingList),
    ],
)
def test_chat_and_embeddings_files(tmp_path: Path, url: str, body: dict[str, Any], body_type: type) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(source, url, {"a": body, "b": body})
    assert main(["run-batch", "-i", str(source), "-o", str(output), *ENGINE_FLAGS]) == 0
    lines = _read(output)
    assert sorted(lines) == ["a-0", "b-0"]
    assert all(isinstance(line.response.body, body_type) for line in lines.values())


def test_invalid_file_runs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(source, "/v1/completions", {"a": {"prompt": "x"}})
    with source.open("a") as f:
        f.write("this line is not JSON\n")
    assert main(["run-batch", "-i", str(source), "-o", str(output), *ENGINE_FLAGS]) == 2
    err = capsys.readouterr().err
    assert "1 invalid line(s); nothing was run" in err and "line 3: invalid_json_line" in err  # blank line 2 counts
    assert not output.exists()


@pytest.mark.parametrize(
    ("config", "says"),
    [({"r": 0}, "its r is 0, not a positive whole number"), ({"lora_alpha": "abc"}, "its lora_alpha is 'abc'")],
)
def test_a_broken_adapter_in_lora_modules_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any], says: str
) -> None:
    adapter = tmp_path / "broken"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(source, "/v1/completions", {"a": {"prompt": "x"}})
    lora = ["--enable-lora", "--lora-modules", f"broken={adapter}"]
    assert main(["run-batch", "-i", str(source), "-o", str(output), *lora, *ENGINE_FLAGS]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "Loading weights" not in err, err
    assert err.startswith("batchgen-server: --lora-modules: LoRA adapter 'broken' cannot be served: ") and says in err
