"""``run-batch --replicas 2`` on the session's Ray, through the real CLI (a module of its own, so that the server
module's replicas have ended before these start: the machine's memory is shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from server_helpers import chat_line, jsonl


def test_run_batch_on_two_replicas(replica_flags: tuple[str, ...], tmp_path: Path) -> None:
    """With a batch-level ``--response-format``: each replica compiles the grammar; every answer follows it."""
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [chat_line(f"offline-{i}", content=f"{i} offline", max_tokens=20) for i in range(12)]
    source.write_bytes(jsonl(lines))
    answer = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"enum": ["yes", "no"]}}}
    command = [sys.executable, "-m", "batchgen.server.cli", "run-batch", "-i", str(source), "-o", str(output)]
    command += ["--response-format", json.dumps(answer)]
    done = subprocess.run([*command, *replica_flags, "--no-progress"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "12/12 completed, 0 failed" in done.stderr
    answered = [json.loads(line) for line in output.read_text().splitlines()]
    assert Counter(line["custom_id"] for line in answered) == Counter(line["custom_id"] for line in lines)
    contents = {line["response"]["body"]["choices"][0]["message"]["content"] for line in answered}
    assert contents <= {'"yes"', '"no"'}
