"""The replica flags (declared once: flag and variable, for serve and run-batch), their usage errors, a clear line
when Ray is missing, and the default path, which never imports Ray. None of these start Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import chat_line, jsonl

from batchgen.server.cli import build_parser, main, settings_from_args
from batchgen.server.settings import Settings


def test_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (Settings().cluster.replicas, Settings().cluster.ray_address) == (0, None)
    from_env = Settings.from_env({"BATCHGEN_REPLICAS": "3", "BATCHGEN_RAY_ADDRESS": "auto"}).cluster
    assert (from_env.replicas, from_env.ray_address) == (3, "auto")
    monkeypatch.setenv("BATCHGEN_REPLICAS", "3")
    for command in ("serve", "run-batch -i in.jsonl -o out.jsonl"):
        args = build_parser().parse_args([*command.split(), "--replicas", "2", "--ray-address", "10.0.0.1:6379"])
        cluster = settings_from_args(args).cluster
        assert (cluster.replicas, cluster.ray_address) == (2, "10.0.0.1:6379")  # the flag wins


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ray-address", "10.0.0.1:6379"], "--ray-address places engine replicas on a Ray cluster: give --replicas"),
        (["--replicas", "-1"], "--replicas -1: give 0 (one engine in this process) or more"),
    ],
)
def test_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_replicas_without_ray_is_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what an installation without the [ray] extra has
    monkeypatch.delitem(sys.modules, "batchgen.server.replicas.ray_cluster", raising=False)
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([chat_line("a")]))
    assert main(["run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--replicas", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "Ray, which is not installed: pip install 'batchgen-server[ray]'" in err


def test_the_default_path_imports_neither_ray_nor_torchao(tmp_path: Path) -> None:
    """One engine in the process, as before: run-batch runs a file and Ray is never imported; nor is torchao, which
    transformers imports whenever it is installed unless the engine defers it (a torchao checkpoint still loads:
    tests/engine/test_quantized.py)."""
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl([chat_line(f"r{i}", max_tokens=2) for i in range(3)]))
    script = (
        "import sys\n"
        "from batchgen.server.cli import main\n"
        f"code = main(['run-batch', '-i', {str(source)!r}, '-o', {str(output)!r}, '--no-progress',\n"
        "             '--torch-threads', '1', '--num-kv-blocks', '64', '--max-num-seqs', '2'])\n"
        "print(code, 'ray' in sys.modules, 'torchao' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.stdout.split() == ["0", "False", "False"], result.stderr[-2000:]
    assert len(output.read_text().splitlines()) == 3
