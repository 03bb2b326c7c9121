"""``run-batch --replicas 2`` on the session's Ray, through the real CLI (a module of its own, so that the server
module's replicas have ended before these start: the machine's memory is shared)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from server_helpers import chat_line, forked_cli, jsonl


def test_run_batch_on_two_replicas(replica_flags: tuple[str, ...], tmp_path: Path) -> None:
    """With a batch-level ``--response-format``: each replica compiles the grammar; every answer follows it."""
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [chat_line(f"offline-{i}", content=f"{i} offline", max_tokens=20) for i in range(12)]
    source.write_bytes(jsonl(lines))
    answer = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"enum": ["yes", "no"]}}}
    argv = ["run-batch", "-i", str(source), "-o", str(output), *replica_flags, "--no-progress"]
    log = tmp_path / "log"
    assert forked_cli([*argv, "--response-format", json.dumps(answer)], log).wait(300) == 0, log.read_text()[-3000:]
    assert "12/12 completed, 0 failed" in log.read_text()
    answered = [json.loads(line) for line in output.read_text().splitlines()]
    assert Counter(line["custom_id"] for line in answered) == Counter(line["custom_id"] for line in lines)
    contents = {line["response"]["body"]["choices"][0]["message"]["content"] for line in answered}
    assert contents <= {'"yes"', '"no"'}
