"""A request that kills the whole process (not an exception: SIGKILL, as native code or the OOM killer would) is
pinned and quarantined across restarts, so a server never sits in a crash loop, and nothing else is lost."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from server_helpers import LiveServer, ServerProcess, assert_exactly_once, chat_line

FAULTS = Path(__file__).parents[1] / "faults"


def test_a_request_that_kills_the_process_twice_is_quarantined(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAULTS), *(p for p in sys.path if p)]),
        "BATCHGEN_TEST_CRASH_MARKER": "14,15,16",
    }
    lines = [chat_line(f"r{i}", content=f"question {i}", max_tokens=4, ignore_eos=True) for i in range(6)]
    lines.insert(3, chat_line("kills-the-process", content="see \x0e\x0f\x10 here", max_tokens=4, ignore_eos=True))
    started: list[ServerProcess] = []
    try:
        first = ServerProcess(storage, env=env).start()
        started.append(first)
        server = LiveServer(first)
        batch = server.create_batch(server.upload(lines)["id"])
        server.http.close()
        assert first.process is not None and first.process.wait(120) == -9  # the first death: a strike each
        # It resumes at once (the struck lines run one at a time) and may die before it ever answers /health.
        second = ServerProcess(storage, env=env).start(wait=False)
        started.append(second)
        assert second.process is not None and second.process.wait(120) == -9  # pinned on the same request
        third = ServerProcess(storage, env=env).start()
        started.append(third)
        server = LiveServer(third)
        finished = server.wait(batch["id"], timeout_s=120)
        assert_exactly_once(server, finished, lines)
        assert finished["request_counts"] == {"total": 7, "completed": 6, "failed": 1}
        (failed,) = server.lines(finished["error_file_id"])
        assert failed["custom_id"] == "kills-the-process" and failed["response"]["status_code"] == 500
        assert failed["response"]["body"]["error"]["message"].startswith("Quarantined")
        server.http.close()
    finally:
        for process in started:
            process.stop()
    journal = [json.loads(line) for line in (storage / "inflight.journal").read_text().splitlines()]
    assert journal == []  # a clean stop leaves nothing open
