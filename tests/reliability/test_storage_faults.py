"""A full or failing disk loses nothing and never lies: results wait in memory while the batch is paused (in_progress,
/health 503, the fault in /v1/pool/status), the loop retries until the disk recovers, and the batch then completes
with every custom_id exactly once; an upload on a full disk answers 507 and leaves nothing behind.

Two ways: a real server on a 20 MB tmpfs that is filled up and then freed (the real thing, database included), and
the server in-process with faults injected into the blob store's system calls (a write cut short then ENOSPC, an
fsync failing with EIO), which a tmpfs cannot produce.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar.types import ASGIApp
from server_helpers import LiveServer, assert_exactly_once, chat_line, jsonl

from batchgen.server.app import create_app
from batchgen.server.engine import EngineConfig
from batchgen.server.launcher import ServerProcess
from batchgen.server.settings import Settings
from batchgen.server.storage import blobs
from batchgen.server.storage.database import Database


def wait_for(condition: Callable[[], Any], timeout_s: float = 60, what: str = "the condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s} s"
        time.sleep(0.05)
    return value


def reported_faults(http: httpx.Client) -> tuple[str | None, str | None]:
    """The storage fault as /health (503 and its reason) and /v1/pool/status report it; ``None`` where healthy."""
    health, pool = http.get("/health"), http.get("/v1/pool/status").json()
    assert health.status_code in (200, 503)
    return (None if health.status_code == 200 else health.json()["reason"]), pool["storage_fault"]


def both_report(http: httpx.Client, fault: str) -> bool:
    reason, pool = reported_faults(http)
    return reason is not None and reason.startswith("storage fault") and fault in reason and fault in (pool or "")


def assert_upload_refused_and_nothing_left(server: LiveServer) -> None:
    before = server.http.get("/v1/files").json()["data"]
    refused = server.http.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("late.jsonl", jsonl([chat_line("late")]))}
    )
    assert refused.status_code == 507, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "insufficient_storage")
    assert server.http.get("/v1/files").json()["data"] == before
    assert list((server.storage_dir / "blobs" / ".tmp").iterdir()) == []


# ---- the real thing: a small tmpfs ----------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_pauses_the_batch_and_it_completes_exactly_once_when_space_returns(
    small_disk: Path, tmp_path: Path
) -> None:
    lines = [chat_line(f"c{i}", content=f"request {i}", max_tokens=2, ignore_eos=True) for i in range(3000)]
    process = ServerProcess(small_disk)
    process.log_path = tmp_path / "server.log"  # not on the disk that fills up
    server = LiveServer(process.start())
    try:
        file_id = server.upload(lines)["id"]
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        filler = small_disk / "filler"
        with open(filler, "wb") as f:  # leave 400 KB: the batch's results (about 2 MB) will not fit
            f.write(b"\0" * (free - 400 * 1024))
        batch_id = server.create_batch(file_id)["id"]

        full = ("No space left on device", "database or disk is full")  # the results files or the database
        wait_for(lambda: any(both_report(server.http, fault) for fault in full), what="the storage fault")
        assert server.batch(batch_id)["status"] == "in_progress"
        assert_upload_refused_and_nothing_left(server)

        filler.unlink()  # space returns: the batch resumes by itself
        batch = server.wait(batch_id, timeout_s=180)
        assert_exactly_once(server, batch, lines)
        assert reported_faults(server.http) == (None, None)
    finally:
        server.http.close()
        process.stop()


# ---- injected faults ------------------------------------------------------------------------------------------------


class FaultyOs:
    """``os`` as the blob store sees it, failing on demand: a write is cut short then fails, an fsync fails."""

    def __init__(self) -> None:
        self.write_error: int | None = None
        self.fsync_error: int | None = None
        self.cut_short = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if self.write_error is None:
            return os.write(fd, data)
        if len(data) > 1 and self.cut_short % 2 == 0:  # half the bytes go down, as on a disk that just filled up
            self.cut_short += 1
            return os.write(fd, data[: len(data) // 2])
        self.cut_short += 1
        raise OSError(self.write_error, os.strerror(self.write_error))

    def fsync(self, fd: int) -> None:
        if self.fsync_error is not None:
            raise OSError(self.fsync_error, os.strerror(self.fsync_error))
        os.fsync(fd)


@pytest.fixture(scope="module")
def faulty() -> Iterator[FaultyOs]:
    with pytest.MonkeyPatch.context() as patch:
        faulty_os = FaultyOs()
        patch.setattr(blobs, "os", faulty_os)
        yield faulty_os


@pytest.fixture(scope="module")
def in_process(
    faulty: FaultyOs, serve: Callable[[ASGIApp], AbstractContextManager[str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    storage = tmp_path_factory.mktemp("faults")
    settings = Settings(
        storage_dir=storage, flush_interval_s=0.05, engine=EngineConfig(torch_threads=1, cpu_kv_cache_gib=0.0625)
    )
    with serve(create_app(settings)) as base_url:
        server = LiveServer(base_url=base_url, storage_dir=storage)
        yield server
        server.http.close()


def test_cut_writes_and_failed_fsyncs_lose_nothing(in_process: LiveServer, faulty: FaultyOs) -> None:
    server = in_process
    lines = [chat_line(f"r{i}", content=f"request {i}", max_tokens=2, ignore_eos=True) for i in range(120)]
    file_id = server.upload(lines)["id"]
    faulty.write_error = errno.ENOSPC
    try:
        batch_id = server.create_batch(file_id)["id"]
        wait_for(lambda: faulty.cut_short >= 4, what="writes cut short")
        wait_for(lambda: both_report(server.http, "No space left on device"), what="the write fault")
        running = server.batch(batch_id)
        assert running["status"] == "in_progress"
        assert server.raw(running["output_file_id"]) == b""  # cut back: no torn line, and nothing claimed
        assert running["request_counts"]["completed"] == 0

        faulty.write_error, faulty.fsync_error = None, errno.EIO  # appends work, fsyncs fail: all appended again
        wait_for(lambda: both_report(server.http, "Input/output error"), what="the fsync fault")
        assert server.batch(batch_id)["request_counts"]["completed"] == 0
    finally:
        faulty.write_error = faulty.fsync_error = None
    batch = server.wait(batch_id, timeout_s=120)
    assert_exactly_once(server, batch, lines)
    assert reported_faults(server.http) == (None, None)


def test_an_upload_that_cannot_be_stored_answers_507(in_process: LiveServer, faulty: FaultyOs) -> None:
    faulty.fsync_error = errno.ENOSPC
    try:
        assert_upload_refused_and_nothing_left(in_process)
    finally:
        faulty.fsync_error = None
    assert in_process.upload([chat_line("after")])["bytes"] > 0


def test_a_delete_the_database_cannot_record_answers_507_and_changes_nothing(
    in_process: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = in_process.upload([chat_line("kept")])

    def full(self: Database, file_id: str) -> None:
        error = sqlite3.OperationalError("database or disk is full")
        error.sqlite_errorcode = sqlite3.SQLITE_FULL  # as SQLite raises it on a full disk
        raise error

    monkeypatch.setattr(Database, "delete_file", full)
    refused = in_process.http.delete(f"/v1/files/{file['id']}")
    assert refused.status_code == 507 and refused.json()["error"]["code"] == "insufficient_storage", refused.text
    assert "database or disk is full" in refused.json()["error"]["message"]
    monkeypatch.undo()
    assert in_process.http.get(f"/v1/files/{file['id']}").json() == file
    assert in_process.raw(file["id"]) == jsonl([chat_line("kept")])
