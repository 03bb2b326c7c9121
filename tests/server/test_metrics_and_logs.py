"""/metrics through prometheus_client: every family docs/server.md documents, parsed by prometheus_client's own
parser, histograms that moved after a batch ran; and the logs an operator reads."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import LiveServer, chat_line

from batchgen.server.observability.logs import JsonFormatter

DOCS = Path(__file__).parents[2] / "docs" / "server.md"


def _documented_families() -> dict[str, str]:
    """The families docs/server.md lists, but the replicas' (only with --replicas: tests/replicas checks them)."""
    section = DOCS.read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    families = dict(re.findall(r"^\| `(batchgen_\w+)` \| (\w+) \|", section, re.M))
    return {name: kind for name, kind in families.items() if not name.startswith("batchgen_replica_")}


def _scrape(server: LiveServer) -> dict[str, object]:
    response = server.http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def _value(families: dict[str, object], name: str, suffix: str = "", **labels: str) -> float:
    family = families[name]
    for sample in family.samples:  # type: ignore[attr-defined]
        if sample.name == name + suffix and all(sample.labels.get(k) == v for k, v in labels.items()):
            return float(sample.value)
    raise AssertionError(f"no sample {name}{suffix} {labels}")


def test_every_documented_family_is_exposed_and_moves(live_server: LiveServer) -> None:
    documented = _documented_families()
    assert len(documented) >= 19
    before = _scrape(live_server)
    batch = live_server.run([chat_line(f"m{i}", max_tokens=5, ignore_eos=True) for i in range(6)])
    assert batch["status"] == "completed"
    after = _scrape(live_server)
    for name, kind in documented.items():
        family_name = name.removesuffix("_total")
        assert family_name in after, f"{name} is documented but not exposed"
        family = after[family_name]
        assert family.type == kind, name  # type: ignore[attr-defined]
        assert all(s.labels.get("model_name") == "demo" for s in family.samples), name  # type: ignore[attr-defined]
    for histogram in (
        "batchgen_time_to_first_token_seconds",
        "batchgen_time_per_output_token_seconds",
        "batchgen_e2e_request_latency_seconds",
        "batchgen_request_queue_time_seconds",
    ):
        moved = _value(after, histogram, "_count") - (_value(before, histogram, "_count") if histogram in before else 0)
        assert moved >= 6, histogram
    assert _value(after, "batchgen_batch_duration_seconds", "_count", status="completed") >= 1
    for counter in ("batchgen_generation_tokens", "batchgen_prompt_tokens"):
        assert _value(after, counter, "_total") - _value(before, counter, "_total") >= 30
    assert _value(after, "batchgen_result_lines_written", "_total", file="output") >= 6
    assert _value(after, "batchgen_batches", status="completed") >= 1
    assert _value(after, "batchgen_engine_healthy") == 1 and _value(after, "batchgen_storage_fault") == 0
    assert 0 <= _value(after, "batchgen_kv_cache_usage_ratio") <= 1
    kv_cache = live_server.http.get("/health").json()["kv_cache"]  # the capacity, in /health and /metrics alike
    assert kv_cache["tokens"] == kv_cache["blocks"] * 16 and kv_cache["bytes"] > 0
    assert _value(after, "batchgen_kv_cache_capacity_tokens", dtype=kv_cache["dtype"]) == kv_cache["tokens"]
    assert _value(after, "batchgen_kv_cache_capacity_bytes", dtype=kv_cache["dtype"]) == kv_cache["bytes"]
    assert "process_resident_memory_bytes" in after  # the standard process metrics come along


def test_counters_print_as_plain_numbers(live_server: LiveServer) -> None:
    """rate() needs exact counts: no '1.23457e+06' as the hand-written exposition had."""
    text = live_server.http.get("/metrics").text
    assert re.search(r"^batchgen_generation_tokens_total\{model_name=\"demo\"\} \d+\.0$", text, re.M)


def test_json_logs_are_one_object_per_line() -> None:
    record = logging.LogRecord("batchgen.server", logging.INFO, __file__, 1, "batch %s started", ("b1",), None)
    entry = json.loads(JsonFormatter().format(record))
    assert (entry["level"], entry["logger"], entry["message"]) == ("info", "batchgen.server", "batch b1 started")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_server_logs_batches_and_activity_but_not_polling(
    fmt: str, live_server: LiveServer, server_factory: Callable[..., LiveServer]
) -> None:
    server = live_server if fmt == "text" else server_factory("--log-format", fmt, "--log-interval-s", "0.2")
    batch = server.run([chat_line(f"l{i}", max_tokens=40, ignore_eos=True) for i in range(8)])
    for _ in range(20):
        server.http.get(f"/v1/batches/{batch['id']}")
        server.http.get("/health")
    activity = re.compile(r"engine: [\d.]+ generated tokens/s, [\d.]+ prompt tokens/s; \d+ running")
    # The activity line comes every 0.2 s while the engine works and once after: a batch that ran within one interval
    # is reported by the line after it, which may come after the batch completed.
    deadline = time.monotonic() + 10
    while True:
        log = server.process.log_path.read_text()
        lines = log.splitlines()
        text = (
            "\n".join(json.loads(line)["message"] for line in lines if line.startswith("{")) if fmt == "json" else log
        )
        if activity.search(text) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert f"batch {batch['id']} created" in text
    assert f"batch {batch['id']} started" in text
    assert re.search(rf"batch {batch['id']} completed \(8 completed, 0 failed\) in \d", text)
    assert activity.search(text)
    assert "GET /v1/batches" not in log and "GET /health" not in log
