"""Settings: defaults, BATCHGEN_* variables, flags over variables; completion windows."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen.server.api.batches import completion_window_hours
from batchgen.server.api.errors import APIError
from batchgen.server.cli import build_parser, main, settings_from_args
from batchgen.server.settings import Settings


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
