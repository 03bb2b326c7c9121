"""A line the serving layer fails on other than by refusing it (a bug, or a body the validation let through) is that
line's 500 ``server_error`` line, logged once with its traceback: every other line of the batch is answered, and the
batch completes. A line slow to become engine requests holds up nothing but itself. The faults are injected into the
in-process server's ``OpenAIServing``."""

from __future__ import annotations

import errno
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from litestar.types import ASGIApp
from server_helpers import LiveServer, chat_line

from batchgen.server.app import create_app
from batchgen.server.engine import EngineConfig
from batchgen.server.serving import OpenAIServing
from batchgen.server.settings import Settings


@pytest.fixture
def server(serve: Callable[[ASGIApp], AbstractContextManager[str]], tmp_path: Path) -> Iterator[LiveServer]:
    settings = Settings(
        storage_dir=tmp_path, flush_interval_s=0.05, engine=EngineConfig(torch_threads=1, cpu_kv_cache_gib=0.0625)
    )
    with serve(create_app(settings)) as base_url:
        live = LiveServer(base_url=base_url, storage_dir=tmp_path)
        yield live
        live.http.close()


def test_a_line_the_server_fails_to_prepare_fails_alone(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    prepare = OpenAIServing.prepare

    def buggy(self: OpenAIServing, body: Any, **kwargs: Any) -> Any:
        if b"trips a bug" in msgspec.json.encode(body):
            raise ValueError("injected bug")
        return prepare(self, body, **kwargs)

    monkeypatch.setattr(OpenAIServing, "prepare", buggy)
    lines = [chat_line(f"r{i}", content=f"request {i}", max_tokens=2, ignore_eos=True) for i in range(200)]
    lines.insert(17, chat_line("bug", content="this trips a bug", max_tokens=2))
    batch = server.run(lines)

    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 201, "completed": 200, "failed": 1}
    output, [error] = server.lines(batch["output_file_id"]), server.lines(batch["error_file_id"])
    assert Counter(line["custom_id"] for line in output) == Counter(f"r{i}" for i in range(200))
    assert error["custom_id"] == "bug" and error["response"]["status_code"] == 500
    detail = error["response"]["body"]["error"]
    assert (detail["type"], detail["code"]) == ("server_error", "server_error")
    assert "injected bug" not in detail["message"]  # the bug is the server's to read, in its log
    logged = [r for r in caplog.records if "bug" in r.getMessage() and r.exc_info is not None]
    assert len(logged) == 1 and "injected bug" in str(logged[0].exc_info[1])  # type: ignore[index]


def test_a_line_that_meets_no_descriptor_left_waits_and_runs(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EMFILE while a line is prepared (the chat template, the tokenizer) is the machine's fault, not the line's:
    the batch pauses, and the line runs once descriptors return."""
    prepare = OpenAIServing.prepare
    failures = iter([OSError(errno.EMFILE, "Too many open files")] * 3)

    def starved(self: OpenAIServing, body: Any, **kwargs: Any) -> Any:
        if b"starved" in msgspec.json.encode(body) and (failure := next(failures, None)) is not None:
            raise failure
        return prepare(self, body, **kwargs)

    monkeypatch.setattr(OpenAIServing, "prepare", starved)
    lines = [chat_line(f"r{i}", max_tokens=2) for i in range(5)]
    lines.insert(2, chat_line("starved", content="starved", max_tokens=2))
    batch = server.run(lines)

    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert next(failures, None) is None  # it was tried until it ran


def test_a_line_slow_to_prepare_holds_up_no_other_batch(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines become engine requests off the batch loop's thread: while one takes long (a huge prompt's chat template,
    say), the lines before it run and are written, and another batch is created, started and cancelled, its line
    waiting to be prepared behind the slow one; then the slow line runs too."""
    prepare = OpenAIServing.prepare
    slow_started, release = threading.Event(), threading.Event()

    def slow(self: OpenAIServing, body: Any, **kwargs: Any) -> Any:
        if b"slow" in msgspec.json.encode(body):
            slow_started.set()
            release.wait(30)
        return prepare(self, body, **kwargs)

    monkeypatch.setattr(OpenAIServing, "prepare", slow)
    lines = [chat_line(f"r{i}", max_tokens=2) for i in range(5)] + [chat_line("slow", content="slow", max_tokens=2)]
    try:
        first = server.create_batch(server.upload(lines)["id"])["id"]
        assert slow_started.wait(30)
        blocked_at = time.monotonic()
        other = server.create_batch(server.upload([chat_line("other", max_tokens=2)])["id"])["id"]
        server.wait(other, timeout_s=10, until={"in_progress"})  # its line waits behind the slow one
        assert server.http.post(f"/v1/batches/{other}/cancel").status_code == 200
        cancelled = server.wait(other, timeout_s=10)
        while server.batch(first)["request_counts"]["completed"] < 5:
            assert time.monotonic() - blocked_at < 10, server.batch(first)
            time.sleep(0.05)
        assert time.monotonic() - blocked_at < 10  # all of it while the slow line was held
    finally:
        release.set()
    assert cancelled["status"] == "cancelled", cancelled
    assert cancelled["request_counts"] == {"total": 1, "completed": 0, "failed": 0}
    batch = server.wait(first, timeout_s=30)
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
