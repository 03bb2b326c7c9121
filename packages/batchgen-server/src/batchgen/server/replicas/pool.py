"""ReplicaPool: engine replicas behind the interface of the single in-process ``EngineWorker`` (``submit`` with a
result callback, ``abort`` by request ids, ``stats``, ``healthy``/``state``/``error``), so the batch loop and
run-batch drive N engines exactly as they drive one.

- **Dispatch** (``Dispatcher``): each request goes to the running replica with the fewest sequences assigned,
  unless the replica that took the last request with the same first block of prompt tokens is at most a quarter of
  a running set busier (its prefix cache holds that block).
- **Results stream back**: one thread per replica long-polls it for the results finished since the last poll.
- **Exactly once**: the pool knows which replica each unanswered request is on, and delivers a result only from
  that replica, once (then forgets the request).
- **Faults**: a replica that cannot be reached, was restarted (its process, or its node, died: Ray starts a new
  one) or whose engine gave up has its unanswered requests dispatched again to the running replicas (held until
  one runs, if none does), so nothing is lost; a result of a moved request that still comes from the old replica
  is dropped, so nothing is answered twice. A streamed request that has reported tokens is failed instead of moved
  (``engine.strikes.cut_stream``), as the engine worker does when it restarts its engine. A replica whose
  engine gave up is restarted (a new process may have a working device); one that cannot load the model after a
  restart is left dead, its error saying why.
- **Strikes** (``engine.strikes``, the crash journal's rule): every request on a replica whose process died gets a
  strike. A struck request runs on probation, never beside another struck one (in the whole pool), so a second
  death is pinned on one request; one with two strikes is answered with a ``server_error`` instead of run again.
  A request that kills whatever process runs it cannot cycle through the replicas forever.

The replicas are reached through ``ReplicaHandle`` (``ray_cluster.RayReplica`` on Ray); this module imports no Ray.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from batchgen.schemas import ReplicaState, ReplicaStatus

from ..engine.interface import ClientState, EngineStats, ResultCallback
from ..engine.request import EngineError, EngineRequest, EngineResult
from ..engine.strikes import Strikes, cut_stream
from .dispatch import Dispatcher, Load
from .replica import ModelInfo, Report, is_final

if TYPE_CHECKING:
    from ..engine.config import EngineConfig

log = logging.getLogger("batchgen.server.replicas")

Deliveries = list[tuple[ResultCallback, EngineResult]]
RECONNECT_S = 1.0
"""How often a replica that cannot be reached is tried again."""
FIRST_ANSWER_S = 30.0
"""The longest ``start`` waits for a replica's first answer (the first one loads the stats' modules here)."""


class ReplicaLost(Exception):
    """The replica did not answer: its process or node died (Ray may be starting a new one), or it is unreachable.
    Whatever it held may be lost."""

    def __init__(self, message: str, *, dead: bool) -> None:
        super().__init__(message)
        self.dead = dead
        """Ray says it will not come back (it may still, if a later poll answers)."""


class ReplicaFailure(Exception):
    """The last failure of a replica, as the pool's ``error`` (what ``/health`` shows)."""


class ReplicaHandle(Protocol):
    """One replica, reached from the server. Calls do not wait for the replica, except ``poll``."""

    def submit(self, requests: list[EngineRequest]) -> None: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def poll(self) -> Report | None:
        """Its news (``None`` if its answer is late); ``ReplicaLost`` if it is gone, or a submit did not reach it."""
        ...

    def restart(self) -> None:
        """End its process, for Ray to start a new one."""

    def kill(self) -> None:
        """End it for good."""


@dataclass(slots=True, eq=False)
class _Replica:
    index: int
    handle: ReplicaHandle
    state: ReplicaState = "starting"
    incarnation: str | None = None
    pid: int | None = None
    node: str | None = None
    stats: EngineStats | None = None
    error: str | None = None
    assigned: int = 0
    """Sequences dispatched to it and not answered."""
    served: int = 0
    restarts: int = 0
    ran: bool = False
    """Its incarnation has run (loaded the model and answered ``running``)."""
    ended: str | None = None
    """The incarnation whose process the pool asked Ray to replace (its engine gave up)."""
    moved: set[str] = field(default_factory=set)
    """Requests taken from it when it could not be reached: aborted there, and their strikes withdrawn, if it answers
    again, still the same process."""
    answered: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True, eq=False)
class _Assignment:
    request: EngineRequest
    on_result: ResultCallback
    replica: _Replica | None = None
    """Where it runs; ``None`` while no replica runs."""
    streamed: bool = False
    """A partial result of it was delivered."""


class ReplicaPool:
    def __init__(
        self,
        handles: list[ReplicaHandle],
        model: ModelInfo,
        config: EngineConfig,
        on_stop: Callable[[], None] = lambda: None,
    ) -> None:
        """``handles`` are replicas that have loaded ``model``; ``on_stop`` runs last in ``stop``."""
        self.tokenizer = model.tokenizer
        self.model_name = model.model_name
        self.max_context_length = model.max_context_length
        self.vocab_size = model.vocab_size
        self.tasks = model.tasks
        self.config = config
        """Every replica's engine config (their seeds differ, so sampled requests draw different seeds)."""
        self.error: BaseException | None = None
        """The last failure of any replica (kept after it recovered, for the record)."""
        self.observer: ResultCallback | None = None
        """Hears of every final result delivered (the metrics)."""
        self._replicas = [_Replica(index, handle) for index, handle in enumerate(handles)]
        self._dispatcher = Dispatcher(config.block_size, slack=max(1, config.max_num_seqs // 4))
        self._lock = threading.Lock()
        self._assigned: dict[str, _Assignment] = {}
        """Every request submitted and not answered nor aborted."""
        self._strikes: Strikes[str] = Strikes()
        """Requests that were on a replica when its process died, by request id."""
        self._stopping = threading.Event()
        self._on_stop = on_stop
        self._threads = [
            threading.Thread(target=self._pump, args=(replica,), name=f"batchgen-replica-{replica.index}", daemon=True)
            for replica in self._replicas
        ]

    # ---- the engine worker's interface --------------------------------------------------------------------------

    @property
    def engines(self) -> int:
        return len(self._replicas)

    @property
    def state(self) -> ClientState:
        """``running`` while a replica runs, ``dead`` once all are dead (or stopped), ``restarting`` in between."""
        states = {replica.state for replica in self._replicas}
        if self._stopping.is_set() or states == {"dead"}:
            return "dead"
        return "running" if "running" in states else "restarting"

    @property
    def healthy(self) -> bool:
        return self.state == "running"

    @property
    def restarts(self) -> int:
        """Replicas restarted, all together (as the engine worker counts its engine's restarts)."""
        return sum(replica.restarts for replica in self._replicas)

    def start(self) -> None:
        """Start collecting results; return once every replica has answered (or ``FIRST_ANSWER_S`` passed)."""
        for thread in self._threads:
            thread.start()
        for replica in self._replicas:
            replica.answered.wait(FIRST_ANSWER_S)

    def stop(self, timeout: float | None = None) -> None:
        """End every replica; what they held is not answered (it runs again at the next start)."""
        self._stopping.set()
        for replica in self._replicas:
            replica.handle.kill()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout)
        self._on_stop()

    def submit(self, requests: list[EngineRequest], on_result: ResultCallback) -> None:
        with self._lock:
            self._dispatch([_Assignment(request, on_result) for request in requests])

    def abort(self, request_ids: list[str]) -> None:
        """Cancel requests wherever they run; no result is reported for them."""
        by_replica: defaultdict[_Replica, list[str]] = defaultdict(list)
        with self._lock:
            for request_id in request_ids:
                assignment = self._assigned.pop(request_id, None)
                if assignment is not None and assignment.replica is not None:
                    assignment.replica.assigned -= assignment.request.params.n
                    by_replica[assignment.replica].append(request_id)
                self._strikes.left(request_id, forget=True)
            for replica, ids in by_replica.items():
                replica.handle.abort(ids)
            self._dispatch_waiting()

    def stats(self) -> EngineStats:
        """The replicas' engine stats added up (every field is a count); a replica restarted counts from zero."""
        with self._lock:
            reported = [replica.stats for replica in self._replicas if replica.stats is not None]
        same = ("fast_paths", "kv_cache_dtype", "state_bytes_per_seq")  # one config: the same on every replica
        counts = [f.name for f in dataclasses.fields(EngineStats) if f.name not in same]
        paths: dict[str, str | None] = {}  # off if off on any replica
        for name, off in (path for stats in reported for path in stats.fast_paths):
            paths[name] = paths.get(name) or off
        totals = {name: sum(getattr(stats, name) for stats in reported) for name in counts}
        dtype = next((stats.kv_cache_dtype for stats in reported), "")  # one config: the same on every replica
        per_seq = next((stats.state_bytes_per_seq for stats in reported), 0)
        return EngineStats(**totals, kv_cache_dtype=dtype, state_bytes_per_seq=per_seq, fast_paths=tuple(paths.items()))

    def replicas(self) -> list[ReplicaStatus]:
        with self._lock:
            return [_status(replica) for replica in self._replicas]

    def _deliver(self, deliveries: Deliveries) -> None:
        """Outside the lock: each result to its callback, and every final one to the observer (the metrics)."""
        for on_result, result in deliveries:
            try:
                on_result(result)
                if self.observer is not None and is_final(result):
                    self.observer(result)
            except Exception:  # the caller's bug must not stop this replica's results
                log.exception("result callback of %s failed", result.request_id)

    # ---- dispatch -----------------------------------------------------------------------------------------------

    def _dispatch(self, assignments: list[_Assignment]) -> None:
        """Send each request to a running replica (or hold it, with none, or while it waits for its probation);
        under the lock."""
        running = [replica for replica in self._replicas if replica.state == "running"]
        loads = {replica.index: _load(replica) for replica in running}
        sent: defaultdict[_Replica, list[EngineRequest]] = defaultdict(list)
        for assignment in assignments:
            request = assignment.request
            self._assigned[request.request_id] = assignment
            if self._strikes.waits(request.request_id):
                continue  # another struck request is out: this one goes once that one is answered
            index = self._dispatcher.choose(request.prompt_token_ids, loads)
            if index is None:
                continue
            self._strikes.entered(request.request_id)
            replica = self._replicas[index]
            assignment.replica = replica
            replica.assigned += request.params.n
            loads[index] = _load(replica)
            sent[replica].append(request)
        for replica, requests in sent.items():
            replica.handle.submit(requests)

    def _dispatch_waiting(self) -> None:
        """Dispatch the requests on no replica (held while none ran, or for their probation); under the lock."""
        waiting = [assignment for assignment in self._assigned.values() if assignment.replica is None]
        if waiting:
            self._dispatch(waiting)

    def _take_back(self, replica: _Replica) -> list[_Assignment]:
        """Every request on ``replica``, now on none; under the lock."""
        taken = [assignment for assignment in self._assigned.values() if assignment.replica is replica]
        for assignment in taken:
            assignment.replica = None
        replica.assigned = 0
        return taken

    # ---- each replica's news ------------------------------------------------------------------------------------

    def _pump(self, replica: _Replica) -> None:
        while not self._stopping.is_set():
            try:
                report = replica.handle.poll()
            except ReplicaLost as exc:
                if not self._stopping.is_set():
                    self._lost(replica, exc)
                    self._stopping.wait(RECONNECT_S)
                continue
            if report is not None:
                self._received(replica, report)
            replica.answered.set()

    def _lost(self, replica: _Replica, exc: ReplicaLost) -> None:
        deliveries: Deliveries = []
        with self._lock:
            state: ReplicaState = "dead" if exc.dead else "restarting"
            if replica.state != state:
                log.warning("replica %d %s: %s", replica.index, "dead" if exc.dead else "lost", exc)
            replica.state, replica.stats = state, None
            self._failed(replica, str(exc))
            self._move_away(replica, deliveries, strike=True)
        self._deliver(deliveries)

    def _received(self, replica: _Replica, report: Report) -> None:
        deliveries: Deliveries = []
        with self._lock:
            if report.incarnation != replica.incarnation:
                if replica.incarnation is not None:  # a new process: what the old one held is gone
                    log.warning("replica %d was restarted (pid %s -> %s)", replica.index, replica.pid, report.pid)
                    replica.restarts += 1
                    self._failed(replica, f"restarted: its process {replica.pid} ended")
                    self._move_away(replica, deliveries, strike=True)
                replica.incarnation, replica.pid, replica.node = report.incarnation, report.pid, report.node
                replica.ran = False
                replica.moved.clear()
            replica.stats = report.stats
            if report.error is not None and report.error != replica.error:
                self._failed(replica, report.error)
            probation_over = False
            for result in report.results:
                assignment = self._assigned.get(result.request_id)
                if assignment is None or assignment.replica is not replica:
                    continue  # aborted, or moved to another replica when this one could not be reached
                if is_final(result):
                    del self._assigned[result.request_id]
                    replica.assigned -= assignment.request.params.n
                    replica.served += 1
                    probation_over |= self._strikes.on_probation == result.request_id
                    self._strikes.left(result.request_id, forget=True)
                else:
                    assignment.streamed = True
                deliveries.append((assignment.on_result, result))
            if probation_over:
                self._dispatch_waiting()
            self._update_state(replica, report, deliveries)
        self._deliver(deliveries)

    def _update_state(self, replica: _Replica, report: Report, deliveries: Deliveries) -> None:
        """Under the lock."""
        if report.state == "dead":
            if replica.ended == replica.incarnation:
                return  # being replaced
            if replica.ran:  # its engine gave up (a broken device?): the others take over, a new process may work
                log.error("replica %d: its engine stopped (%s); restarting its process", replica.index, report.error)
                replica.state, replica.ended = "restarting", replica.incarnation
                self._move_away(replica, deliveries, strike=False)  # its engine's own strikes covered its steps
                replica.handle.restart()
            elif replica.state != "dead":  # restarted, it could not load the model: left dead, its error says why
                log.error("replica %d could not start: %s", replica.index, report.error)
                replica.state = "dead"
            return
        was_running = replica.state == "running"
        replica.state = "running" if report.state == "running" else "restarting"
        if replica.state != "running":
            return
        replica.ran = True
        if not was_running:
            log.info("replica %d running (pid %s on %s)", replica.index, replica.pid, replica.node)
            self._dispatch_waiting()
        if replica.moved:  # the same process answers again: it did not die, and what it held is not struck
            stale = [request_id for request_id in replica.moved if self._where(request_id) is not replica]
            self._strikes.withdraw(replica.moved)
            replica.moved.clear()
            if stale:
                replica.handle.abort(stale)

    def _move_away(self, replica: _Replica, deliveries: Deliveries, *, strike: bool) -> None:
        """Dispatch the requests of a replica that lost them, or may have, to the running ones, but fail those that
        streamed tokens (added to ``deliveries``); with ``strike`` (its process died, or cannot be reached: Ray tells
        a dead process it restarts from an unreachable one only later), each gets a strike, withdrawn if the same
        process answers again, and one with two is quarantined (answered with an error). Under the lock."""
        taken = self._take_back(replica)
        if taken:
            log.warning("replica %d: %d request(s) dispatched again", replica.index, len(taken))
        replica.moved.update(assignment.request.request_id for assignment in taken)
        again = []
        for assignment in taken:
            request_id = assignment.request.request_id
            self._strikes.left(request_id, forget=False)
            if strike:
                self._strikes.strike([request_id])
            if assignment.streamed:
                result = cut_stream(assignment.request, replica.error)
            elif self._strikes.quarantined(request_id):
                log.error("request %s quarantined: the replica running it died twice", request_id)
                result = self._quarantined(assignment.request, replica)
            else:
                again.append(assignment)
                continue
            del self._assigned[request_id]
            self._strikes.left(request_id, forget=True)
            deliveries.append((assignment.on_result, result))
        self._dispatch(again)
        self._dispatch_waiting()  # a probation ended with its replica: the next struck request may go

    def _quarantined(self, request: EngineRequest, replica: _Replica) -> EngineResult:
        message = (
            "The engine could not run this request: the replica running it died each of the two times it ran; it is "
            f"not run again (last failure: {replica.error})."
        )
        error = EngineError("server_error", message)
        return EngineResult(request.request_id, len(request.prompt_token_ids), error=error)

    def _where(self, request_id: str) -> _Replica | None:
        assignment = self._assigned.get(request_id)
        return None if assignment is None else assignment.replica

    def _failed(self, replica: _Replica, message: str) -> None:
        replica.error = message
        self.error = ReplicaFailure(f"replica {replica.index}: {message}")


def _load(replica: _Replica) -> Load:
    return Load(replica.assigned, replica.stats.kv_blocks_free if replica.stats else 0)


def _status(replica: _Replica) -> ReplicaStatus:
    stats = replica.stats
    return ReplicaStatus(
        index=replica.index,
        state=replica.state,
        node=replica.node,
        pid=replica.pid,
        assigned_requests=replica.assigned,
        running_requests=stats.running if stats else 0,
        served_requests=replica.served,
        kv_blocks_total=stats.kv_blocks_total if stats else 0,
        kv_blocks_free=stats.kv_blocks_free if stats else 0,
        restarts=replica.restarts,
        error=replica.error,
    )
