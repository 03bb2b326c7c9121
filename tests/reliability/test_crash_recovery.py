"""kill -9 at several points of a batch's life, then a restart on the same storage: every request answered once.

The soak script (``benchmarks/soak.py``) kills at random moments over many batches; these are the deterministic
points: right after the batch is accepted (validating), mid-decode, again during the recovery itself, and the two
states a kill during finalization leaves behind.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from server_helpers import LiveServer, ServerProcess, assert_exactly_once, chat_line

Start = Callable[[], LiveServer]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    """Start a server on the test's storage; every one started is stopped at the end, whatever the outcome."""
    started: list[LiveServer] = []

    def start() -> LiveServer:
        started.append(LiveServer(ServerProcess(tmp_path).start()))
        return started[-1]

    yield start
    for server in started:
        server.http.close()
        server.process.stop()


def kill_9(server: LiveServer) -> None:
    assert server.process.process is not None
    server.process.process.kill()
    server.process.process.wait()


def test_kill_right_after_the_batch_is_accepted(start: Start) -> None:
    lines = [chat_line(f"r{i}", content=f"request {i}", max_tokens=2, ignore_eos=True) for i in range(200)]
    server = start()
    batch_id = server.create_batch(server.upload(lines)["id"])["id"]
    kill_9(server)  # while the batch is validating, or just after: the runner had milliseconds

    server = start()
    assert_exactly_once(server, server.wait(batch_id, timeout_s=120), lines)


def test_kill_mid_decode_and_again_during_recovery(start: Start) -> None:
    lines = [chat_line(f"short-{i}", max_tokens=2, ignore_eos=True) for i in range(6)]
    # Long enough to be still decoding when the short ones are seen done (400 tokens left 0.4 s, missed once under
    # the suite's load).
    lines += [chat_line(f"long-{i}", max_tokens=900, ignore_eos=True) for i in range(4)]
    server = start()
    batch_id = server.create_batch(server.upload(lines)["id"])["id"]
    deadline = time.monotonic() + 60
    while (batch := server.batch(batch_id))["request_counts"]["completed"] < 6:
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    assert batch["status"] == "in_progress"
    kill_9(server)  # mid-decode: the short requests are written, the long ones are half-way

    server = start()
    kill_9(server)  # at once: while the restarted runner re-reads the results and resubmits

    server = start()
    assert_exactly_once(server, server.wait(batch_id, timeout_s=120), lines)


@pytest.mark.parametrize(
    "published",
    [
        pytest.param(False, id="before-publishing"),
        pytest.param(True, id="after-publishing"),
    ],
)
def test_a_crash_during_finalization_is_finished_on_restart(tmp_path: Path, start: Start, published: bool) -> None:
    lines = [chat_line(f"r{i}", max_tokens=3, ignore_eos=True) for i in range(4)]
    if not published:  # a request answered with an error keeps the error file, so both files await publishing
        lines.append(chat_line("too-long", content="word " * 5000, max_tokens=3))
    server = start()
    done = server.run(lines)
    assert done["status"] == "completed"
    assert (done["error_file_id"] is None) == published
    kill_9(server)
    # Finalizing lasts milliseconds (finalizing -> results files published -> completed): too short to hit by chance.
    # Put the storage in the state a kill there leaves: status finalizing, live counters behind the files, and the
    # results files either not yet published or published (the empty error file already dropped).
    with sqlite3.connect(tmp_path / "batchgen.db") as db:
        db.execute(
            "UPDATE batches SET status = 'finalizing', completed_at = NULL, completed = 1, output_tokens = 3 "
            "WHERE id = ?",
            (done["id"],),
        )
        if not published:
            db.execute(
                "UPDATE files SET status = 'uploaded' WHERE id IN (?, ?)",
                (done["output_file_id"], done["error_file_id"]),
            )

    server = start()
    batch = server.wait(done["id"], timeout_s=20)
    assert_exactly_once(server, batch, lines)
    assert (batch["output_file_id"], batch["error_file_id"]) == (done["output_file_id"], done["error_file_id"])
    for file_id in (batch["output_file_id"], batch["error_file_id"]):
        if file_id is not None:
            assert server.http.get(f"/v1/files/{file_id}").json()["status"] == "processed"
