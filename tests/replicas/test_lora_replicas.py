"""LoRA adapters on two replicas, through ``run-batch`` (the real CLI): a file mixing the base and two adapters, each
line answered as peft's own forward of its adapter answers it (a module of its own: replicas hold memory)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from server_helpers import jsonl

TOKENS = 8


def test_run_batch_mixes_adapters_on_two_replicas(
    replica_flags: tuple[str, ...],
    tmp_path: Path,
    lora_adapters: dict[str, Path],
    peft_text: Callable[[list[int], int, str | None], str],
) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = [[7 * i % 256 for i in range(3 + j, 20 + j)] for j in range(4)]
    names = ["demo", "alpha", "beta"]
    lines = [
        {
            "custom_id": f"{name}-{j}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": name, "prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True},
        }
        for j, prompt in enumerate(prompts)
        for name in names
    ]
    source.write_bytes(jsonl(lines))
    command = [sys.executable, "-m", "batchgen.server.cli", "run-batch", "-i", str(source), "-o", str(output)]
    command += ["--enable-lora", "--lora-modules", *(f"{name}={lora_adapters[name]}" for name in ("alpha", "beta"))]
    command += ["--max-loras", "2", "--max-lora-rank", "8"]
    done = subprocess.run([*command, *replica_flags, "--no-progress"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{len(lines)}/{len(lines)} completed, 0 failed" in done.stderr
    answers = {line["custom_id"]: line["response"]["body"] for line in map(json.loads, output.read_text().splitlines())}
    for j, prompt in enumerate(prompts):
        for name in names:
            body = answers[f"{name}-{j}"]
            assert body["model"] == name
            assert body["choices"][0]["text"] == peft_text(prompt, TOKENS, None if name == "demo" else name), name
