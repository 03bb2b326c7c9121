"""The server's Prometheus metrics, through prometheus_client (exposition format, histograms, process metrics).

Two kinds of families. Histograms of request latencies and batch durations are observed as things finish (the
engine worker reports every finished request, the batch store every finished batch). Everything else is read at
scrape time from the state the server already keeps (the engine's counters and gauges, the batch loop's status, the
database's batch counts), so nothing is counted twice. Every batchgen family carries a ``model_name`` label; the
standard ``process_*`` and ``python_*`` families come with the registry. docs/server.md lists the families with
example PromQL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from batchgen.schemas import BatchObject, ReplicaStatus
from batchgen.schemas.batches import STATUSES, TERMINAL_STATUSES

from ..engine.interface import EngineStats
from ..engine.request import EngineResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Batch work waits in queues for minutes or hours: the buckets reach a day where vLLM's stop at minutes.
LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
    1800,
    3600,
    7200,
    21600,
    86400,
)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 10, 30, 60, 300, 900, 1800, 3600, 7200, 14400, 28800, 57600, 86400, 172800, 1209600)


@dataclass(frozen=True, slots=True)
class ServerState:
    """What a scrape reads, each a cheap call (the batch counts are one SQL aggregate)."""

    engine: Callable[[], EngineStats]
    engine_state: Callable[[], str]
    """``running``, ``restarting`` or ``dead``."""
    engine_restarts: Callable[[], int]
    queued_sequences: Callable[[], int]
    storage_fault: Callable[[], str | None]
    batch_counts: Callable[[], dict[str, int]]
    """Batches by status."""
    line_counts: Callable[[], dict[str, int]]
    """Result lines written over all batches: ``completed`` (output file) and ``failed`` (error file)."""
    replicas: Callable[[], list[ReplicaStatus] | None]
    """Each engine replica's state with ``--replicas`` (``None`` with the single in-process engine)."""


class Metrics:
    def __init__(self, model_name: str, state: ServerState) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        labels = ["model_name"]

        def histogram(name: str, help_text: str, buckets: tuple[float, ...], extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, help_text, [*labels, *extra], buckets=buckets, registry=self.registry)

        self.queue_time = histogram(
            "batchgen_request_queue_time_seconds",
            "Time from a request entering the engine to its first step.",
            LATENCY_BUCKETS,
        )
        self.time_to_first_token = histogram(
            "batchgen_time_to_first_token_seconds",
            "Time from a request entering the engine to its first token.",
            LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "batchgen_time_per_output_token_seconds",
            "Mean time between a request's output tokens after the first.",
            TOKEN_BUCKETS,
        )
        self.e2e_latency = histogram(
            "batchgen_e2e_request_latency_seconds",
            "Time from a request entering the engine to its result.",
            LATENCY_BUCKETS,
        )
        self.batch_duration = histogram(
            "batchgen_batch_duration_seconds",
            "Time from a batch's creation to its final status, by that status.",
            BATCH_BUCKETS,
            ("status",),
        )
        self.requests = Counter(
            "batchgen_requests",
            "Engine requests finished (batch lines and online calls), by outcome.",
            [*labels, "outcome"],
            registry=self.registry,
        )
        self.registry.register(_StateCollector(model_name, state))
        # Every series exists from the start (at zero), so rate() and dashboards see it before its first event.
        for family in (self.queue_time, self.time_to_first_token, self.time_per_output_token, self.e2e_latency):
            family.labels(model_name)
        for outcome in ("success", "error"):
            self.requests.labels(model_name, outcome)
        for status in sorted(TERMINAL_STATUSES):
            self.batch_duration.labels(model_name, status)

    def observe_request(self, result: EngineResult) -> None:
        """A request the engine finished (the worker calls this for every result it delivers)."""
        self.requests.labels(self.model_name, "error" if result.error else "success").inc()
        times = result.times
        if times is None:
            return
        self.queue_time.labels(self.model_name).observe(times.scheduled - times.arrival)
        self.e2e_latency.labels(self.model_name).observe(times.finished - times.arrival)
        if times.first_token is not None:
            self.time_to_first_token.labels(self.model_name).observe(times.first_token - times.arrival)
            per_choice = result.completion_tokens // max(1, len(result.outputs))
            if per_choice > 1:
                mean = (times.finished - times.first_token) / (per_choice - 1)
                self.time_per_output_token.labels(self.model_name).observe(mean)

    def observe_batch(self, batch: BatchObject) -> None:
        """A batch that reached its final status (the batch store calls this)."""
        end = max(t or 0 for t in (batch.completed_at, batch.failed_at, batch.cancelled_at, batch.expired_at))
        if end:
            self.batch_duration.labels(self.model_name, batch.status).observe(max(0, end - batch.created_at))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """The families read at scrape time from the server's own state."""

    def __init__(self, model_name: str, state: ServerState) -> None:
        self.model_name = model_name
        self.state = state

    def collect(self) -> Iterator[Metric]:
        model = [self.model_name]
        stats = self.state.engine()

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric(model, value)
            return family

        def counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric(model, value)
            return family

        yield gauge("batchgen_num_requests_running", "Sequences running in the engine.", stats.running)
        yield gauge("batchgen_num_requests_waiting", "Sequences waiting in the engine to be admitted.", stats.queued)
        yield gauge(
            "batchgen_queued_sequences",
            "Sequences of unfinished batches not done yet (in or before the engine).",
            self.state.queued_sequences(),
        )
        used = stats.kv_blocks_total - stats.kv_blocks_free
        yield gauge(
            "batchgen_kv_cache_usage_ratio",
            "Share of KV-cache blocks in use (0 to 1).",
            used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0,
        )
        if stats.kv_cache_dtype:
            for name, help_text, value in (
                ("batchgen_kv_cache_capacity_tokens", "Tokens the KV cache holds (its blocks x the block size).",
                 stats.kv_cache_tokens),
                ("batchgen_kv_cache_capacity_bytes", "Memory of the KV cache (every layer's K and V).",
                 stats.kv_cache_bytes),
            ):  # fmt: skip
                capacity = GaugeMetricFamily(name, help_text + " Its dtype in a label.", labels=["model_name", "dtype"])
                capacity.add_metric([self.model_name, stats.kv_cache_dtype], value)
                yield capacity
        # Models with state layers: the state cache, in the same memory budget as the KV cache (0 without).
        yield gauge("batchgen_state_cache_capacity_bytes", "Memory of the state cache (every slot).",
                    stats.state_cache_bytes)  # fmt: skip
        yield gauge("batchgen_state_cache_slots", "Slots of the state cache: running sequences' and checkpoints.",
                    stats.state_slots)  # fmt: skip
        yield gauge("batchgen_state_checkpoints", "Prefix checkpoints of the state held.", stats.state_checkpoints)
        yield gauge("batchgen_state_bytes_per_sequence", "Memory of one sequence's state (every state layer).",
                    stats.state_bytes_per_seq)  # fmt: skip
        yield counter(
            "batchgen_prompt_tokens", "Prompt tokens computed or served from the prefix cache.", stats.prompt_tokens
        )
        yield counter(
            "batchgen_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", stats.cached_tokens
        )
        yield counter("batchgen_generation_tokens", "Tokens generated.", stats.generated_tokens)
        yield counter("batchgen_preemptions", "Sequences preempted for KV-cache space.", stats.preemptions)
        engine_state = self.state.engine_state()
        yield gauge(
            "batchgen_engine_healthy",
            "1 while the engine runs, 0 while it restarts or has stopped.",
            1 if engine_state == "running" else 0,
        )
        yield counter(
            "batchgen_engine_restarts", "Times the engine was restarted after a failure.", self.state.engine_restarts()
        )
        yield gauge(
            "batchgen_storage_fault",
            "1 while results cannot be written (batches paused), else 0.",
            0 if self.state.storage_fault() is None else 1,
        )
        batches = GaugeMetricFamily("batchgen_batches", "Batches, by status.", labels=["model_name", "status"])
        counts = self.state.batch_counts()
        for status in STATUSES:
            batches.add_metric([self.model_name, status], counts.get(status, 0))
        yield batches
        lines = CounterMetricFamily(
            "batchgen_result_lines_written", "Result lines durably written, by file.", labels=["model_name", "file"]
        )
        written = self.state.line_counts()
        lines.add_metric([self.model_name, "output"], written.get("completed", 0))
        lines.add_metric([self.model_name, "error"], written.get("failed", 0))
        yield lines
        paths = GaugeMetricFamily(
            "batchgen_fast_path_enabled",
            "1 while a fast path of the engine serves, 0 once it is off (the reason in its label).",
            labels=["model_name", "path", "reason"],
        )
        for name, off in stats.fast_paths:
            paths.add_metric([self.model_name, name, off or ""], 0 if off else 1)
        yield paths
        replicas = self.state.replicas()
        if replicas is not None:
            yield from _replica_families(self.model_name, replicas)


def _replica_families(model_name: str, replicas: list[ReplicaStatus]) -> Iterator[Metric]:
    """With ``--replicas``: each replica's state and load, labelled ``replica`` (its index)."""
    labels = ["model_name", "replica"]
    up = GaugeMetricFamily("batchgen_replica_up", "1 while the replica's engine runs, else 0.", labels=labels)
    running = GaugeMetricFamily("batchgen_replica_running_requests", "Sequences the replica runs.", labels=labels)
    assigned = GaugeMetricFamily(
        "batchgen_replica_assigned_requests", "Sequences dispatched to the replica, not answered yet.", labels=labels
    )
    kv = GaugeMetricFamily(
        "batchgen_replica_kv_cache_usage_ratio", "The replica's KV-cache use, 0 to 1.", labels=labels
    )
    served = CounterMetricFamily("batchgen_replica_served_requests", "Results the replica returned.", labels=labels)
    restarts = CounterMetricFamily(
        "batchgen_replica_restarts", "Times the replica's process was replaced.", labels=labels
    )
    for replica in replicas:
        key = [model_name, str(replica.index)]
        up.add_metric(key, 1 if replica.state == "running" else 0)
        running.add_metric(key, replica.running_requests)
        assigned.add_metric(key, replica.assigned_requests)
        used = replica.kv_blocks_total - replica.kv_blocks_free
        kv.add_metric(key, used / replica.kv_blocks_total if replica.kv_blocks_total else 0.0)
        served.add_metric(key, replica.served_requests)
        restarts.add_metric(key, replica.restarts)
    yield from (up, running, assigned, kv, served, restarts)
