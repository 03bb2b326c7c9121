"""The pool's bookkeeping when a replica is lost, comes back unchanged, is replaced or gives up, step by step.

The replicas here are scripted (the one fake of these tests): a real Ray cannot be made, on cue, to lose a replica's
answer and then bring the same process back, or to report a result twice. ``test_replicas.py`` kills real ones.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator

import pytest

from batchgen.server.engine.config import EngineConfig
from batchgen.server.engine.interface import ClientState
from batchgen.server.engine.request import EngineRequest, EngineResult
from batchgen.server.replicas import pool as pool_module
from batchgen.server.replicas.pool import ReplicaLost, ReplicaPool
from batchgen.server.replicas.replica import ModelInfo, Report


class ScriptedReplica:
    """A ``ReplicaHandle`` whose polls answer what the test ``feed``s it (a report, or a ``ReplicaLost`` to raise)."""

    def __init__(self) -> None:
        self.news: queue.Queue[Report | ReplicaLost] = queue.Queue()
        self.submitted: list[list[str]] = []
        self.aborted: list[list[str]] = []
        self.restarts = 0
        self._taken = False

    def feed(self, item: Report | ReplicaLost) -> None:
        """Hand the pool ``item`` and return once it has dealt with it (it polls again only then)."""
        self.news.put(item)
        self.news.join()

    def submit(self, requests: list[EngineRequest]) -> None:
        self.submitted.append([request.request_id for request in requests])

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.append(list(request_ids))

    def poll(self) -> Report | None:
        if self._taken:  # the pool is back for more: it has dealt with the last item
            self._taken = False
            self.news.task_done()
        try:
            item = self.news.get(timeout=0.01)
        except queue.Empty:
            return None
        self._taken = True
        if isinstance(item, ReplicaLost):
            raise item
        return item

    def restart(self) -> None:
        self.restarts += 1

    def kill(self) -> None:
        pass


def report(incarnation: str, *done: str, state: ClientState = "running") -> Report:
    results = [EngineResult(request_id, prompt_tokens=3) for request_id in done]
    return Report(incarnation, pid=100, node="node", state=state, error=None, stats=None, results=results)


def request(request_id: str) -> EngineRequest:
    return EngineRequest(request_id, [1, 2, 3])  # shorter than a block: dispatched by load alone


@pytest.fixture
def make_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., ReplicaPool]]:
    monkeypatch.setattr(pool_module, "RECONNECT_S", 0.01)
    started: list[ReplicaPool] = []

    def make(*replicas: ScriptedReplica) -> ReplicaPool:
        model = ModelInfo(
            tokenizer=None, model_name="demo", max_context_length=64, vocab_size=259, tasks=frozenset({"generate"})
        )
        started.append(ReplicaPool(list(replicas), model, EngineConfig()))
        started[-1].start()
        return started[-1]

    yield make
    for pool in started:
        pool.stop(timeout=5)


def test_moved_requests_are_answered_once_by_the_replica_they_moved_to(make_pool: Callable[..., ReplicaPool]) -> None:
    a, b = ScriptedReplica(), ScriptedReplica()
    pool = make_pool(a, b)
    a.feed(report("a1"))
    b.feed(report("b1"))
    answered: list[str] = []
    pool.submit([request("r1"), request("r2")], lambda result: answered.append(result.request_id))
    assert (a.submitted, b.submitted) == ([["r1"]], [["r2"]])

    b.feed(ReplicaLost("unreachable", dead=False))  # its process may still run r2: r2 goes to a all the same
    assert a.submitted[-1] == ["r2"]
    assert [replica.state for replica in pool.replicas()] == ["running", "restarting"]
    assert pool.healthy

    b.feed(report("b1", "r2"))  # b is back, the same process, with r2 done: dropped, and b drops r2
    assert answered == [] and b.aborted == [["r2"]]
    a.feed(report("a1", "r1", "r2"))
    a.feed(report("a1", "r2"))  # a result delivered already is never delivered again
    assert answered == ["r1", "r2"]
    statuses = pool.replicas()
    assert [s.served_requests for s in statuses] == [2, 0] and [s.assigned_requests for s in statuses] == [0, 0]
    assert statuses[1].error == "unreachable" and statuses[1].restarts == 0


def test_a_restarted_replica_is_sent_its_requests_again(make_pool: Callable[..., ReplicaPool]) -> None:
    a = ScriptedReplica()
    pool = make_pool(a)
    a.feed(report("first"))
    answered: list[str] = []
    pool.submit([request("r1"), request("r2")], lambda result: answered.append(result.request_id))
    a.feed(report("first", "r1"))
    a.feed(report("second"))  # a new process (Ray restarted it): r2 was lost with the old one
    assert a.submitted == [["r1", "r2"], ["r2"]]
    a.feed(report("second", "r2"))
    assert answered == ["r1", "r2"] and pool.replicas()[0].restarts == 1


def test_with_no_replica_running_requests_wait_then_run(make_pool: Callable[..., ReplicaPool]) -> None:
    a = ScriptedReplica()
    pool = make_pool(a)
    a.feed(report("first"))
    a.feed(ReplicaLost("gone", dead=True))
    assert pool.state == "dead" and not pool.healthy
    pool.submit([request("r1")], lambda result: None)
    assert a.submitted == []  # held: nowhere to run
    a.feed(report("second"))
    assert a.submitted == [["r1"]] and pool.healthy


def test_an_engine_that_gave_up_is_restarted_but_one_that_never_ran_is_left_dead(
    make_pool: Callable[..., ReplicaPool],
) -> None:
    a, b = ScriptedReplica(), ScriptedReplica()
    pool = make_pool(a, b)
    a.feed(report("a1"))
    b.feed(report("b1"))
    pool.submit([request("r1"), request("r2")], lambda result: None)
    b.feed(report("b1", state="dead"))  # its engine stopped for good: r2 goes to a, b's process is replaced
    assert a.submitted[-1] == ["r2"] and b.restarts == 1
    b.feed(report("b2", state="dead"))  # the new process could not load the model: not restarted again
    assert b.restarts == 1 and [s.state for s in pool.replicas()] == ["running", "dead"]
    assert pool.healthy


def test_a_request_that_kills_its_replicas_is_struck_out_and_the_rest_are_answered(
    make_pool: Callable[..., ReplicaPool],
) -> None:
    """The crash journal's rule over replicas: each death strikes what the dead process held; a struck request runs
    on probation (never beside another struck one), and one struck twice is answered with an error, not sent on."""
    a, b = ScriptedReplica(), ScriptedReplica()
    pool = make_pool(a, b)
    a.feed(report("a1"))
    b.feed(report("b1"))
    answered: dict[str, EngineResult] = {}
    pool.submit([request(f"r{i}") for i in range(4)], lambda result: answered.update({result.request_id: result}))
    assert (a.submitted, b.submitted) == ([["r0", "r2"]], [["r1", "r3"]])

    a.feed(ReplicaLost("the actor died", dead=True))  # r0 and r2 each get a strike: r0 on probation, r2 waits
    assert b.submitted[-1] == ["r0"]
    b.feed(report("b1", "r1", "r0"))  # r0's probation is over (answered): r2's turn
    assert b.submitted[-1] == ["r2"]
    b.feed(report("b2"))  # b's process died running r2 (and r3): r2's second strike, r3's first
    error = answered["r2"].error
    assert error is not None and error.code == "server_error" and "died each of the two times" in error.message
    assert b.submitted[-1] == ["r3"]  # on b's new process, alone among the struck (a is still down)
    b.feed(report("b2", "r3"))
    assert sorted(answered) == ["r0", "r1", "r2", "r3"]
    assert all(answered[f"r{i}"].error is None for i in (0, 1, 3))
