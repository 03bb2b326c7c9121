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
from server_helpers import LiveServer, ServerProcess, assert_exactly_once, chat_line, jsonl

from batchgen.server.app import create_app
from batchgen.server.batches import crashes
from batchgen.server.batches.stores import DatabaseStore
from batchgen.server.engine import EngineConfig
from batchgen.server.run_batch import offline_batch
from batchgen.server.serving import BatchDefaults
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


def assert_upload_refused_and_nothing_left(
    server: LiveServer, status: int = 507, code: str = "insufficient_storage"
) -> httpx.Response:
    before = server.http.get("/v1/files").json()["data"]
    refused = server.http.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("late.jsonl", jsonl([chat_line("late")]))}
    )
    assert refused.status_code == status, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", code)
    after = server.http.get("/v1/files").json()["data"]
    assert after == before
    blobs_dir = server.storage_dir / "blobs"
    assert list((blobs_dir / ".tmp").iterdir()) == []
    assert {path.name for path in blobs_dir.iterdir()} - {".tmp"} <= {file["id"] for file in after}, "a stray blob"
    return refused


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
    """``os`` as the blob store sees it, failing on demand: a write is cut short then fails, an fsync fails, opening
    a file fails (``os.open`` and, through ``open_file``, the builtin ``open``)."""

    def __init__(self) -> None:
        self.write_error: int | None = None
        self.fsync_error: int | None = None
        self.open_error: int | None = None
        self.cut_short = 0
        self.refused_opens = 0
        self.refused_fsyncs = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, path: Any, flags: int, mode: int = 0o777) -> int:
        self._check_open(path)
        return os.open(path, flags, mode)

    def open_file(self, file: Any, *args: Any, **kwargs: Any) -> Any:
        self._check_open(file)
        return open(file, *args, **kwargs)

    def _check_open(self, path: Any) -> None:
        if self.open_error is not None:
            self.refused_opens += 1
            raise OSError(self.open_error, os.strerror(self.open_error), str(path))

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
            self.refused_fsyncs += 1
            raise OSError(self.fsync_error, os.strerror(self.fsync_error))
        os.fsync(fd)


@pytest.fixture(scope="module")
def faulty() -> Iterator[FaultyOs]:
    with pytest.MonkeyPatch.context() as patch:
        faulty_os = FaultyOs()
        patch.setattr(blobs, "os", faulty_os)
        patch.setattr(blobs, "open", faulty_os.open_file, raising=False)  # shadows the builtin there only
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


def test_a_failed_upload_leaves_no_blob_even_once_its_content_was_in_place(
    in_process: LiveServer, faulty: FaultyOs
) -> None:
    faulty.open_error = errno.ENOSPC  # the content is renamed into place; fsyncing its directory fails
    try:
        assert_upload_refused_and_nothing_left(in_process)
    finally:
        faulty.open_error = None


# ---- results files changed under a running batch ---------------------------------------------------------------------


def running_with_lines_durable(server: LiveServer, name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A batch whose short lines are durable while its one long line still decodes (for seconds): what the test does
    next happens while it runs, and takes effect when that line's answer is written."""
    lines = [chat_line(f"{name}{i}", content=f"request {i}", max_tokens=2, ignore_eos=True) for i in range(40)]
    lines.append(chat_line(f"{name}-long", content="a long answer", max_tokens=800, ignore_eos=True))
    batch_id = server.create_batch(server.upload(lines)["id"])["id"]
    wait_for(lambda: server.batch(batch_id)["request_counts"]["completed"] >= 40, what="the short lines durable")
    running = server.batch(batch_id)
    assert running["status"] == "in_progress", running
    return running, lines


@pytest.mark.parametrize("change", ["deleted", "replaced"])
def test_a_results_file_deleted_or_replaced_under_a_running_batch_is_put_back_and_nothing_is_lost(
    in_process: LiveServer, faulty: FaultyOs, change: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = in_process
    running, lines = running_with_lines_durable(server, change)
    blob = server.storage_dir / "blobs" / running["output_file_id"]
    blob.unlink()
    if change == "replaced":
        blob.write_bytes(b'{"not": "ours"}\n')
    faulty.fsync_error = errno.EIO  # putting it back fails at first: the batch pauses, and retries
    try:
        wait_for(lambda: both_report(server.http, "Input/output error"), what="the pause")
        refused = faulty.refused_fsyncs
        wait_for(lambda: faulty.refused_fsyncs > refused, what="a retry")
        assert server.batch(running["id"])["status"] == "in_progress"
    finally:
        faulty.fsync_error = None
    batch = server.wait(running["id"], timeout_s=60)
    assert_exactly_once(server, batch, lines)
    assert f"{running['output_file_id']} was deleted or replaced while its batch ran" in caplog.text
    assert list((server.storage_dir / "blobs" / ".tmp").iterdir()) == []  # no copy left behind
    assert reported_faults(server.http) == (None, None)


def test_a_results_file_cut_short_under_a_running_batch_fails_it_with_a_clear_error(in_process: LiveServer) -> None:
    server = in_process
    running, _ = running_with_lines_durable(server, "cut")
    blob = server.storage_dir / "blobs" / running["output_file_id"]
    os.truncate(blob, blob.stat().st_size // 2)  # lines counted as done are gone: no copy of them anywhere
    batch = server.wait(running["id"], timeout_s=60)
    assert batch["status"] == "failed", batch
    [error] = batch["errors"]["data"]
    assert error["code"] == "internal_error"
    assert f"{running['output_file_id']} was cut short outside the server" in error["message"]
    assert str(server.storage_dir) not in error["message"]
    server.raw(batch["output_file_id"])  # what is left is published as it is: its download matches its checksum
    assert reported_faults(server.http) == (None, None)


def test_completing_a_batch_whose_results_file_is_missing_is_refused(tmp_path: Path) -> None:
    store = DatabaseStore(Database(tmp_path / "db.sqlite"), blobs.BlobStore(tmp_path / "blobs"))
    batch = offline_batch(BatchDefaults())
    store.insert(batch, "")
    started = store.start(batch, "", status="in_progress")
    assert started.output_file_id is not None
    store.blobs.delete(started.output_file_id)
    with pytest.raises(blobs.ResultsLost, match="disappeared"):
        store.finish(started, status="completed")
    store.finish(started, status="failed")  # what failed anyway publishes what there is: nothing
    finished = store.get(batch.id, "")
    assert finished is not None and (finished.status, finished.output_file_id) == ("failed", None)


# ---- downloads and inputs --------------------------------------------------------------------------------------------


def test_a_download_is_checked_against_the_files_size_and_checksum(
    in_process: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    content = jsonl([chat_line(f"d{i}") for i in range(50)])
    file = in_process.upload(content)
    blob = in_process.storage_dir / "blobs" / file["id"]
    digests = 0
    digest = blobs._digest

    def counted(f: Any) -> str:
        nonlocal digests
        digests += 1
        return digest(f)

    monkeypatch.setattr(blobs, "_digest", counted)
    assert in_process.raw(file["id"]) == in_process.raw(file["id"]) == content
    assert digests == 1, "hashed again although the file did not change"
    # Shorter, the same size, longer:
    for damaged in (content[: len(content) // 2], content[:-2] + b"!\n", content + b"{}\n"):
        blob.write_bytes(damaged)
        response = in_process.http.get(f"/v1/files/{file['id']}/content")
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "file_content_corrupt")
        assert file["id"] in error["message"] and str(in_process.storage_dir) not in error["message"]
    blob.write_bytes(content)
    assert in_process.raw(file["id"]) == content


def test_a_batch_whose_input_is_missing_fails_without_showing_server_paths(in_process: LiveServer) -> None:
    file = in_process.upload([chat_line("lost")])
    (in_process.storage_dir / "blobs" / file["id"]).unlink()
    batch = in_process.wait(in_process.create_batch(file["id"])["id"])
    assert batch["status"] == "failed", batch
    [error] = batch["errors"]["data"]
    assert error["message"] == f"The server could not run the batch: No such file or directory: {file['id']}"


# ---- out of file descriptors -----------------------------------------------------------------------------------------


def pauses_logged(caplog: pytest.LogCaptureFixture, batch_id: str) -> int:
    return sum(batch_id in r.getMessage() and "paused by a storage fault" in r.getMessage() for r in caplog.records)


def test_no_descriptor_left_pauses_the_batch_and_refuses_requests_503_until_they_return(
    in_process: LiveServer, faulty: FaultyOs, caplog: pytest.LogCaptureFixture
) -> None:
    server = in_process
    kept = server.upload([chat_line("kept")])
    lines = [chat_line(f"e{i}", content=f"request {i}", max_tokens=2, ignore_eos=True) for i in range(30)]
    file_id = server.upload(lines)["id"]
    faulty.open_error, faulty.refused_opens = errno.EMFILE, 0
    try:
        batch_id = server.create_batch(file_id)["id"]  # its results files cannot be opened
        wait_for(lambda: both_report(server.http, "Too many open files"), what="the fault")
        assert server.batch(batch_id)["status"] == "in_progress"
        refused = assert_upload_refused_and_nothing_left(server, 503, "resources_exhausted")
        download = server.http.get(f"/v1/files/{kept['id']}/content")
        for response in (refused, download):
            assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
            assert response.json()["error"]["code"] == "resources_exhausted"
        wait_for(lambda: faulty.refused_opens >= 5, what="retries")
    finally:
        faulty.open_error = None
    batch = server.wait(batch_id, timeout_s=60)
    assert_exactly_once(server, batch, lines)
    assert reported_faults(server.http) == (None, None)
    assert pauses_logged(caplog, batch_id) == 1


def test_no_descriptor_left_while_finalizing_pauses_the_batch_and_it_completes_by_itself(
    in_process: LiveServer, faulty: FaultyOs, caplog: pytest.LogCaptureFixture
) -> None:
    server = in_process
    running, lines = running_with_lines_durable(server, "f")
    faulty.open_error, faulty.refused_opens = errno.EMFILE, 0  # its files are open: it runs, and cannot publish them
    try:
        wait_for(lambda: server.batch(running["id"])["status"] == "finalizing", what="finalizing")
        wait_for(lambda: both_report(server.http, "Too many open files"), what="the fault")
        wait_for(lambda: faulty.refused_opens >= 3, what="retries")
        assert server.batch(running["id"])["status"] == "finalizing"
    finally:
        faulty.open_error = None
    batch = server.wait(running["id"], timeout_s=60)
    assert_exactly_once(server, batch, lines)
    assert reported_faults(server.http) == (None, None)
    assert pauses_logged(caplog, running["id"]) == 1


def test_the_crash_journal_goes_on_when_no_descriptor_is_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = crashes.CrashJournal(tmp_path / "inflight.journal")
    monkeypatch.setattr(crashes, "COMPACT_BYTES", 0)  # every append compacts: the file is closed and reopened

    def no_descriptor(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(crashes, "open", no_descriptor, raising=False)
    journal.entered("b", "c1")  # its reopen fails: logged, not raised (the journal is advisory)
    journal.entered("b", "c2")
    monkeypatch.delattr(crashes, "open")
    journal.entered("b", "c3")  # descriptors are back: so is the journal
    assert set(crashes.CrashJournal(tmp_path / "inflight.journal").strikes.counts) == {
        ("b", "c1"),
        ("b", "c2"),
        ("b", "c3"),
    }
