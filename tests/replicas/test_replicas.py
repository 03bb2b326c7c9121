"""Two CPU replicas of the demo model on a local Ray, over the real API: a batch is spread over both, a cancel
reaches both, LoRA adapters are served on both, a replica killed with SIGKILL mid-batch loses nothing and duplicates
nothing (Ray restarts it), and a line that kills every replica it runs on is struck out."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from server_helpers import LiveServer, assert_exactly_once, chat_line


def _replicas(server: LiveServer) -> list[dict[str, Any]]:
    replicas: list[dict[str, Any]] = server.http.get("/v1/pool/status").json()["replicas"]
    return replicas


def _served(server: LiveServer) -> list[int]:
    return [replica["served_requests"] for replica in _replicas(server)]


def _lines(prefix: str, count: int, max_tokens: int) -> list[dict[str, Any]]:
    """Prompts that differ in their first block, so that prefix affinity does not pin them to one replica."""
    return [
        chat_line(f"{prefix}-{i}", content=f"{i} {prefix}", max_tokens=max_tokens, ignore_eos=True)
        for i in range(count)
    ]


def _wait_until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_batch_is_spread_over_both_replicas(replica_server: LiveServer) -> None:
    server = replica_server
    health = server.http.get("/health")
    assert health.status_code == 200
    replicas = health.json()["replicas"]
    assert [(r["index"], r["state"]) for r in replicas] == [(0, "running"), (1, "running")]
    assert len({r["pid"] for r in replicas}) == 2 and os.getpid() not in {r["pid"] for r in replicas}
    before = _served(server)

    lines = _lines("spread", 24, max_tokens=16)
    assert_exactly_once(server, server.run(lines), lines)

    shares = [after - earlier for after, earlier in zip(_served(server), before, strict=True)]
    assert sum(shares) == len(lines)  # each result delivered once, from one replica
    assert min(shares) >= 2, shares  # both served a share (the least loaded takes more: one may be slower)
    pool = server.http.get("/v1/pool/status").json()
    assert pool["kv_blocks_total"] == sum(r["kv_blocks_total"] for r in pool["replicas"]) == 2 * 256
    assert all(r["assigned_requests"] == 0 for r in pool["replicas"])
    metrics = {f.name: f for f in text_string_to_metric_families(server.http.get("/metrics").text)}
    up = {s.labels["replica"]: s.value for s in metrics["batchgen_replica_up"].samples}
    assert up == {"0": 1.0, "1": 1.0}
    served = {s.labels["replica"]: s.value for s in metrics["batchgen_replica_served_requests"].samples}
    assert sum(served.values()) >= len(lines)


def test_a_batch_mixing_adapters_and_the_base_is_answered_as_peft(
    replica_server: LiveServer, peft_text: Callable[[list[int], int, str | None], str]
) -> None:
    tokens = 8
    prompts = [[7 * i % 256 for i in range(3 + j, 20 + j)] for j in range(4)]
    names = ["demo", "alpha", "beta"]
    lines = [
        {
            "custom_id": f"{name}-{j}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": name, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True},
        }
        for j, prompt in enumerate(prompts)
        for name in names
    ]
    batch = replica_server.run(lines, endpoint="/v1/completions")
    assert batch["request_counts"] == {"total": len(lines), "completed": len(lines), "failed": 0}, batch
    answers = {line["custom_id"]: line["response"]["body"] for line in replica_server.lines(batch["output_file_id"])}
    for j, prompt in enumerate(prompts):
        for name in names:
            body = answers[f"{name}-{j}"]
            assert body["model"] == name
            assert body["choices"][0]["text"] == peft_text(prompt, tokens, None if name == "demo" else name), name


def test_a_cancel_reaches_both_replicas(replica_server: LiveServer) -> None:
    server = replica_server
    batch = server.create_batch(server.upload(_lines("cancel", 12, max_tokens=1500))["id"])
    _wait_until(lambda: all(r["running_requests"] > 0 for r in _replicas(server)), 60, "both replicas run the batch")
    assert server.http.post(f"/v1/batches/{batch['id']}/cancel").status_code == 200
    assert server.wait(batch["id"], timeout_s=10)["status"] == "cancelled"
    _wait_until(
        lambda: all(r["assigned_requests"] == r["running_requests"] == 0 for r in _replicas(server)),
        10,
        "both replicas dropped the cancelled requests",
    )


def test_a_replica_killed_mid_batch_loses_nothing_and_duplicates_nothing(replica_server: LiveServer) -> None:
    server = replica_server
    before = _served(server)
    lines = _lines("kill", 40, max_tokens=48)
    batch_id = server.create_batch(server.upload(lines)["id"])["id"]
    _wait_until(lambda: server.batch(batch_id)["request_counts"]["completed"] >= 4, 60, "the batch runs")
    victim = _replicas(server)[1]
    assert victim["assigned_requests"] > 0 and server.batch(batch_id)["status"] == "in_progress"

    os.kill(victim["pid"], signal.SIGKILL)
    _wait_until(lambda: _replicas(server)[1]["state"] == "restarting", 10, "the pool sees the replica gone")
    health = server.http.get("/health")
    assert health.status_code == 200  # the other replica still serves
    assert [r["state"] for r in health.json()["replicas"]] == ["running", "restarting"]

    batch = server.wait(batch_id, timeout_s=120)
    assert_exactly_once(server, batch, lines)
    _wait_until(lambda: _replicas(server)[1]["state"] == "running", 120, "Ray restarts the replica")
    restarted = _replicas(server)[1]
    assert restarted["restarts"] == 1 and restarted["pid"] != victim["pid"]
    assert restarted["error"]  # why it was lost, for the record
    shares = [after - earlier for after, earlier in zip(_served(server), before, strict=True)]
    assert sum(shares) == len(lines), shares  # what the dead replica had was answered once, by the other

    lines = _lines("after", 8, max_tokens=4)  # the restarted replica takes work again
    before = _served(server)
    assert_exactly_once(server, server.run(lines), lines)
    assert all(after > earlier for after, earlier in zip(_served(server), before, strict=True))


def test_a_line_that_kills_every_replica_it_runs_on_is_struck_out_and_the_batch_completes(
    replica_server: LiveServer,
) -> None:
    """The line holding the crash marker kills the replica process running it (SIGKILL, as native code or the OOM
    killer would): struck each time, run alone among the struck, answered with an error after its second death;
    every other line is answered once, and Ray brings both replicas back."""
    server = replica_server
    _wait_until(lambda: [r["state"] for r in _replicas(server)] == ["running"] * 2, 120, "both replicas run")
    restarts = sum(replica["restarts"] for replica in _replicas(server))
    lines = _lines("poison", 8, max_tokens=4)
    lines.insert(3, chat_line("kills-its-replica", content="see \x0e\x0f\x10 here", max_tokens=4, ignore_eos=True))
    batch = server.wait(server.create_batch(server.upload(lines)["id"])["id"], timeout_s=180)
    assert_exactly_once(server, batch, lines)
    assert batch["request_counts"] == {"total": 9, "completed": 8, "failed": 1}
    (failed,) = server.lines(batch["error_file_id"])
    assert failed["custom_id"] == "kills-its-replica" and failed["response"]["status_code"] == 500
    assert "died each of the two times" in failed["response"]["body"]["error"]["message"]
    _wait_until(lambda: [r["state"] for r in _replicas(server)] == ["running"] * 2, 120, "Ray restarts both")
    assert sum(replica["restarts"] for replica in _replicas(server)) == restarts + 2


def test_pooling_lines_are_spread_and_equal_to_online(replica_server: LiveServer) -> None:
    """A batch of ``/pooling`` lines over both replicas: each answered once, with the vector an online request for the
    same input gets (whichever replica answers it), and both replicas served a share."""
    server = replica_server
    before = _served(server)
    inputs = [f"{i} pooled passage" for i in range(12)]
    lines = [
        {"custom_id": f"pool-{i}", "method": "POST", "url": "/pooling", "body": {"model": "demo", "input": text}}
        for i, text in enumerate(inputs)
    ]
    batch = server.run(lines, endpoint="/pooling")
    assert batch["status"] == "completed" and batch["request_counts"]["failed"] == 0, batch
    vectors = {
        line["custom_id"]: line["response"]["body"]["data"][0]["data"] for line in server.lines(batch["output_file_id"])
    }
    assert sorted(vectors) == sorted(line["custom_id"] for line in lines)
    shares = [after - earlier for after, earlier in zip(_served(server), before, strict=True)]
    assert sum(shares) == len(lines) and min(shares) >= 1, shares
    for i, text in enumerate(inputs[:4]):
        online = server.http.post("/pooling", json={"model": "demo", "input": text})
        assert online.status_code == 200, online.text
        expected = online.json()["data"][0]["data"]
        assert max(abs(a - b) for a, b in zip(vectors[f"pool-{i}"], expected, strict=True)) < 1e-5
