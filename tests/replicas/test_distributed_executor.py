"""``--distributed-executor-backend ray``: a model in two pipeline stages whose second stage is a Ray actor, placed
by a placement group on the session's local Ray (``conftest.py``: the one Ray the replica tests share), joined
through ``RAY_ADDRESS``. It passes the engine's self-check at start (the split forward against the model's own) and
gives the tokens one process gives; the group's end removes its placement group. And replicas of a split model:
servers with ``--replicas`` and ``--tensor-parallel-size``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from server_helpers import LiveServer, ServerProcess, assert_exactly_once

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams, build_engine


def _greedy(engine: LLMEngine) -> list[int]:
    engine.add_request(EngineRequest("r", list(range(3, 40)), SamplingParams(max_tokens=8, ignore_eos=True)))
    while engine.has_unfinished_requests():
        if done := engine.step():
            return done[0].outputs[0].token_ids
    raise AssertionError("no result")


def test_a_stage_placed_by_ray(ray_address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray  # only now: Ray reads RAY_AUTH_MODE (set by the session's fixture) as it is imported

    from batchgen.server.engine.distributed.ray_ranks import RayLauncher, RayRank

    monkeypatch.setenv("RAY_ADDRESS", ray_address)
    settings = {"dtype": "float32", "device": "cpu", "torch_threads": 1, "num_kv_blocks": 64}
    engine = build_engine(
        EngineConfig(**settings, pipeline_parallel_size=2, distributed_executor_backend="ray", distributed_timeout_s=20)
    )
    assert isinstance(engine, LLMEngine) and engine.runner.group is not None
    group = engine.runner.group
    assert isinstance(group.launcher, RayLauncher) and group.launcher.group is not None
    placed = group.launcher.group
    try:
        (stage,) = group.processes
        assert isinstance(stage, RayRank)
        pid = ray.get(stage.actor.pid.remote(), timeout=30)
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert os.getpid() not in (pid, parent)  # a Ray worker's process, not a child of this one
        assert ray.util.placement_group_table(placed)["state"] == "CREATED"
        tokens = _greedy(engine)
    finally:
        group.stop()  # the placement group removed, this process's Ray connection closed
    assert not ray.is_initialized()
    ray.init(address=ray_address)
    try:
        assert ray.util.placement_group_table()[placed.id.hex()]["state"] == "REMOVED"
    finally:
        ray.shutdown()
    assert _greedy(build_engine(EngineConfig(**settings))) == tokens  # one process, the same tokens


def test_replicas_of_a_split_model(
    replica_flags: tuple[str, ...], live_server: LiveServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``--replicas 2 --tensor-parallel-size 2``: each replica a group of two ranks (the actor's own processes, on
    the CPUs Ray reserved for it); a batch spread over both replicas gives the tokens one process gives."""
    flags = (*replica_flags, "--tensor-parallel-size", "2")
    with ServerProcess(tmp_path_factory.mktemp("replicas-tp"), *flags) as process:
        server = LiveServer(process)
        bodies = [
            {
                "model": "demo",
                "prompt": [7 * i % 256 for i in range(3 + j, 20 + j)],
                "max_tokens": 6,
                "ignore_eos": True,
            }
            for j in range(6)
        ]
        lines = [
            {"custom_id": f"tp-{j}", "method": "POST", "url": "/v1/completions", "body": body}
            for j, body in enumerate(bodies)
        ]
        batch = server.run(lines, endpoint="/v1/completions")
        assert_exactly_once(server, batch, lines)
        served = [replica["served_requests"] for replica in server.http.get("/v1/pool/status").json()["replicas"]]
        assert len(served) == 2 and min(served) >= 1, served
        texts = {
            line["custom_id"]: line["response"]["body"]["choices"][0]["text"]
            for line in server.lines(batch["output_file_id"])
        }
        server.http.close()
    one_process = {
        f"tp-{j}": live_server.http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        for j, body in enumerate(bodies)
    }
    assert texts == one_process
