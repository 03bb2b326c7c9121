"""Settings: declared once (flag, variable, default, help), flags over variables, --help without the model stack,
the storage default, a corrupt database at start-up; completion windows."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchgen.server.api.batches import completion_window_hours
from batchgen.server.api.errors import APIError
from batchgen.server.cli import build_parser, main, settings_from_args
from batchgen.server.engine.config import EngineConfig
from batchgen.server.options import add_flags, build, options, setting
from batchgen.server.serving.config import ServingConfig
from batchgen.server.settings import Settings
from batchgen.server.storage.database import Database


def test_environment_variables() -> None:
    settings = Settings.from_env(
        {
            "BATCHGEN_PORT": "1234",
            "BATCHGEN_API_KEYS": "a, b,",
            "BATCHGEN_STORAGE_DIR": "/data/batchgen",
            "BATCHGEN_MODEL": "/models/tiny",
            "BATCHGEN_FLUSH_INTERVAL_S": "0.2",
        }
    )
    assert (settings.port, settings.api_keys, settings.storage_dir) == (1234, ("a", "b"), Path("/data/batchgen"))
    assert (settings.engine.model, settings.flush_interval_s, settings.host) == ("/models/tiny", 0.2, "127.0.0.1")
    assert settings.database_path == Path("/data/batchgen/batchgen.db")


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHGEN_PORT", "9999")
    monkeypatch.setenv("BATCHGEN_MAX_QUEUED_REQUESTS", "7")
    monkeypatch.setenv("BATCHGEN_MODEL", "from-env")
    args = build_parser().parse_args(
        ["serve", "--port", "5", "--api-key", "k1", "--api-key", "k2", "--max-num-seqs", "8", "--storage", "s"]
    )
    settings = settings_from_args(args)
    assert (settings.port, settings.max_queued_requests, settings.api_keys) == (5, 7, ("k1", "k2"))
    assert (settings.engine.model, settings.engine.max_num_seqs, settings.storage_dir) == ("from-env", 8, Path("s"))


@pytest.mark.parametrize(("window", "hours"), [("24h", 24), ("336h", 336), ("1d", 24), ("7d", 168), ("14d", 336)])
def test_completion_windows(window: str, hours: int) -> None:
    assert completion_window_hours(window) == hours


@pytest.mark.parametrize("window", ["23h", "337h", "15d", "0d", "24", "24 h", "1w", "-24h", "24.5h", ""])
def test_bad_completion_windows(window: str) -> None:
    with pytest.raises(APIError) as raised:
        completion_window_hours(window)
    assert (raised.value.status_code, raised.value.param) == (400, "completion_window")


@pytest.mark.parametrize(
    ("args", "environ"),
    [
        (["--host", "0.0.0.0"], {}),
        (["--host", "192.168.1.20"], {"BATCHGEN_INSECURE": "0"}),
        (["--host", "::"], {"BATCHGEN_API_KEYS": ""}),
    ],
)
def test_serve_refuses_a_public_bind_without_a_key(
    args: list[str], environ: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("BATCHGEN_API_KEYS", "BATCHGEN_INSECURE", "BATCHGEN_HOST"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", *args, "--port", "1"]) == 2  # refused before any model is loaded or port bound
    message = capsys.readouterr().err
    assert "Refusing to listen on" in message and "--api-key" in message and "--insecure" in message


def test_insecure_and_callback_hosts_from_flags_and_environment() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--insecure", "--callback-allowed-host", "a.example", "--callback-allowed-host", "127.0.0.1"]
    )
    settings = settings_from_args(args)
    assert settings.insecure is True
    assert settings.callbacks.allowed_hosts == frozenset({"a.example", "127.0.0.1"})
    from_env = Settings.from_env(
        {
            "BATCHGEN_INSECURE": "true",
            "BATCHGEN_CALLBACK_ALLOWED_HOSTS": "hooks.local, 10.0.0.5",
            "BATCHGEN_SHUTDOWN_TIMEOUT_S": "5",
        }
    )
    assert (from_env.insecure, from_env.callback_allowed_hosts) == (True, ("hooks.local", "10.0.0.5"))
    assert from_env.shutdown_timeout_s == 5.0
    assert Settings().callbacks.allowed_hosts == frozenset() and Settings().insecure is False


@pytest.mark.parametrize("cls", [Settings, EngineConfig])
def test_every_setting_is_a_flag_and_a_variable(cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """One declaration per field: its flag and its BATCHGEN_* variable both set it, and the flag wins."""
    declared = options(cls)
    assert {option.name for option in declared} == {f.name for f in dataclasses.fields(cls)} - {
        "engine",
        "cluster",
        "serving",
    }
    samples = {bool: (True, "1", "--{}"), int: (7, "7", "7"), float: (0.25, "0.25", "0.25")}
    samples |= {str: ("x", "x", "x"), Path: (Path("/p"), "/p", "/p"), tuple: (("a", "b"), "a,b", "a")}
    for option in declared:
        value, env_text, flag_text = samples[option.kind]
        if option.kind is bool:
            value = not option.default
            env_text = "1" if value else "0"
        environ = {option.env: env_text}
        assert getattr(build(cls, environ=environ), option.name) == value, option
        assert getattr(build(cls, environ={}), option.name) == option.default
        flag = option.flags[0]
        argv = [flag if value else f"--no-{flag[2:]}"] if option.kind is bool else [flag, flag_text]
        parsed = build_parser().parse_args(["serve", *argv])
        from_flag = build(cls, parsed, environ={option.env: "1" if option.kind is bool and not value else env_text})
        expected = ("a",) if option.kind is tuple else value
        assert getattr(from_flag, option.name) == expected, option


def test_a_field_declared_once_is_a_flag_and_a_variable() -> None:
    @dataclasses.dataclass
    class Knobs:
        attention_backend: str = setting("sdpa", "which attention kernels to use")
        skip_self_check: bool = setting(False, "skip the load-time self-check")

    parser = argparse.ArgumentParser()
    add_flags(parser, Knobs, "knobs")
    assert "which attention kernels to use [default: sdpa; env BATCHGEN_ATTENTION_BACKEND]" in " ".join(
        parser.format_help().split()
    )
    knobs = build(Knobs, parser.parse_args(["--skip-self-check"]), {"BATCHGEN_ATTENTION_BACKEND": "flash"})
    assert (knobs.attention_backend, knobs.skip_self_check) == ("flash", True)
    with pytest.raises(ValueError, match="BATCHGEN_SKIP_SELF_CHECK='maybe'"):
        build(Knobs, environ={"BATCHGEN_SKIP_SELF_CHECK": "maybe"})


def test_help_and_version_answer_without_loading_the_model_stack() -> None:
    """--help imports argparse and the declarations only: no torch, transformers, litestar, uvicorn, httpx or ray."""
    script = (
        "import contextlib, io, sys\n"
        "from batchgen.server.cli import main\n"
        "out = io.StringIO()\n"
        "for argv in (['--help'], ['serve', '--help'], ['run-batch', '--help'], ['--version']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out):\n"
        "        main(argv)\n"
        "heavy = ('torch', 'transformers', 'litestar', 'uvicorn', 'httpx', 'ray')\n"
        "print(sorted(name for name in heavy if name in sys.modules))\n"
        "print(out.getvalue())\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    loaded, _, text = result.stdout.partition("\n")
    assert loaded == "[]"
    help_text = " ".join(text.split())  # argparse wraps to the terminal's width
    assert "batchgen-server 0.1.0" in help_text
    assert "--max-num-seqs INT" in help_text and "[default: 256; env BATCHGEN_MAX_NUM_SEQS]" in help_text
    assert "``" not in help_text  # no reST markup


def test_the_default_storage_is_a_data_directory_not_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", "/srv/data")
    assert Settings().storage_dir == Path("/srv/data/batchgen")
    monkeypatch.delenv("XDG_DATA_HOME")
    assert Settings().storage_dir == Path.home() / ".local" / "share" / "batchgen"


def test_a_corrupt_database_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "batchgen.db").write_bytes(b"this is not a database" * 100)
    assert main(["serve", "--storage", str(tmp_path), "--port", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{tmp_path / 'batchgen.db'} cannot be read" in err and "backup" in err


def test_a_bad_variable_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("BATCHGEN_PORT", "ten")
    with pytest.raises(SystemExit) as exited:
        main(["serve"])
    assert exited.value.code == 2 and "BATCHGEN_PORT='ten': not a valid int" in capsys.readouterr().err


def test_adapters_without_enable_lora_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--lora-modules", "a=/adapters/a"])
    assert exited.value.code == 2 and "--lora-modules needs --enable-lora" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--distributed-timeout-s", "0"], "--distributed-timeout-s 0: give a number of seconds over 0"),
        (["--distributed-timeout-s", "-5"], "--distributed-timeout-s -5: give a number of seconds over 0"),
        (["--grammar-timeout-s", "nan"], "--grammar-timeout-s nan: give a number of seconds over 0"),
        (["--media-fetch-timeout-s", "0"], "--media-fetch-timeout-s must be positive, not 0"),
        (
            ["--max-request-image-pixels", "100", "--max-image-pixels-in-flight", "10"],
            "--max-request-image-pixels (100) is over --max-image-pixels-in-flight (10)",
        ),
    ],
)
def test_timeouts_and_budgets_that_cannot_work_are_usage_errors(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 0 or negative timeout timed every collective out at once (or never, for NaN)."""
    with pytest.raises(SystemExit) as exited:
        main(["serve", *flags])
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture
def read_only_disk(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs that a test fills, then remounts read-only (root only: the storage-fault tests mount one too)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.parametrize("with_database", [False, True])
def test_read_only_storage_is_one_line_and_exit_1(
    read_only_disk: Path, with_database: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    storage = read_only_disk / "storage"
    if with_database:
        storage.mkdir()
        Database(storage / "batchgen.db").close()
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_disk)], check=True)
    assert main(["serve", "--storage", str(storage), "--port", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "cannot be written: Read-only file system" in err


def test_the_chat_output_parsers_are_vllm_flags_checked_before_anything_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    assert settings_from_args(build_parser().parse_args(argv)).serving == ServingConfig(True, "hermes", "qwen3")
    monkeypatch.setenv("BATCHGEN_TOOL_CALL_PARSER", "mistral")
    assert Settings.from_env().serving.tool_call_parser == "mistral"
    monkeypatch.delenv("BATCHGEN_TOOL_CALL_PARSER")
    for flags, message in (
        (["--tool-call-parser", "nope"], "unknown tool call parser 'nope'; valid: hermes,"),
        (["--reasoning-parser", "nope"], "unknown reasoning parser 'nope'; valid: deepseek_r1, qwen3"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    ):
        with pytest.raises(SystemExit):
            main(["serve", *flags])
        assert message in capsys.readouterr().err


def _open_files(path: Path) -> int:
    """This process's descriptors open on ``path`` (and its WAL and shared-memory files)."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if str(fd.resolve(strict=False)).startswith(str(path)))


def test_closing_the_database_closes_every_threads_connection(tmp_path: Path) -> None:
    import threading

    db = Database(tmp_path / "batchgen.db")
    threads = [threading.Thread(target=db.batch_status_counts) for _ in range(3)]  # each opens its own
    for thread in threads:
        thread.start()
        thread.join()
    assert _open_files(tmp_path / "batchgen.db") >= 4
    db.close()
    assert _open_files(tmp_path / "batchgen.db") == 0


def test_a_start_that_fails_midway_stops_what_it_had_started(tmp_path: Path) -> None:
    """The model cannot load once the database, the sweeper and the notifier run: each is stopped again."""
    import asyncio

    from batchgen.server.app import create_app
    from batchgen.server.engine.errors import ModelLoadError

    settings = Settings(storage_dir=tmp_path / "storage")
    settings.engine.model = str(tmp_path / "no-such-model")

    async def start() -> None:
        app = create_app(settings)
        with pytest.raises(BaseException) as raised:  # Litestar's task group may wrap it
            async with app.lifespan():
                pass
        assert "no model at" in str(raised.value) or any(
            isinstance(exc, ModelLoadError) for exc in getattr(raised.value, "exceptions", ())
        )
        left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        assert left == []  # the sweeper is gone

    asyncio.run(start())
    assert _open_files(tmp_path / "storage" / "batchgen.db") == 0
