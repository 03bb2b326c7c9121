"""The batch loop in-process, with run-batch's plain-file store and real engine workers: an engine replaced mid-batch
gets every request that was inside it again. And the order of turns (tenants, then their batches)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from batchgen.server.batches.loop import BatchLoop
from batchgen.server.batches.stores import FileStore
from batchgen.server.batches.turns import Turns
from batchgen.server.engine import EngineRequest, EngineResult, EngineWorker, LLMEngine
from batchgen.server.run_batch import offline_batch
from batchgen.server.serving import BatchDefaults, OpenAIServing


class CountingWorker(EngineWorker):
    """A real worker that also counts the requests it was given."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine)
        self.submitted: list[str] = []

    def submit(self, requests: list[EngineRequest], on_result: Callable[[EngineResult], None]) -> None:
        self.submitted += [request.request_id for request in requests]
        super().submit(requests, on_result)


def test_a_replaced_engine_gets_what_was_inside(make_engine: Callable[..., LLMEngine], tmp_path: Path) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "demo", "prompt": f"request {i}", "max_tokens": 2 if i < 3 else 40, "ignore_eos": True},
        }
        for i in range(12)
    ]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    engine = make_engine()
    serving = OpenAIServing(engine.tokenizer, ("demo",), engine.max_context_length)
    first = CountingWorker(engine)
    store = FileStore(source, output, None)
    loop = BatchLoop(store, serving, first, capacity=1000, window=4, flush_interval_s=0.05)
    first.start()
    loop.start()
    replacement = CountingWorker(make_engine())
    try:
        loop.admit(offline_batch(BatchDefaults()), "", 12).result(timeout=10)
        deadline = time.monotonic() + 30
        while store.fields.get("completed", 0) < 3:  # the short ones; long ones fill the window now
            assert time.monotonic() < deadline, store.fields
            time.sleep(0.01)
        first.stop(timeout=10)  # the engine "dies": whatever was inside it is lost
        replacement.start()
        loop.engine_restarted(replacement)
        assert store.finished.wait(60), store.fields
    finally:
        loop.stop(timeout=10)
        replacement.stop(timeout=10)
    assert store.fields["status"] == "completed"
    answered = _custom_ids(output)
    assert Counter(answered) == Counter(line["custom_id"] for line in lines)  # each exactly once
    assert store.fields["completed"] == 12 and store.fields["failed"] == 0
    assert set(replacement.submitted) & set(first.submitted), "what was inside the first engine went to the second"


def _custom_ids(path: Path) -> list[str]:
    return [json.loads(line)["custom_id"] for line in path.read_text().splitlines()]


def test_turns_even_out_the_engine_between_tenants_then_batches() -> None:
    turns: Turns[str] = Turns()
    for tenant, batch in (("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1")):
        turns.add(tenant, batch)
    running = dict.fromkeys(["a1", "a2", "a3", "b1", "c1"], 0)

    def take() -> str | None:
        item = turns.next(lambda _: True, running.__getitem__)
        if item is not None:
            running[item] += 1
        return item

    # Equal shares: round-robin, each tenant every third turn however many batches it has, which share its turns.
    assert [take() for _ in range(9)] == ["a1", "b1", "c1", "a2", "b1", "c1", "a3", "b1", "c1"]
    # A newcomer holds nothing: it takes every place until it holds as much as the others.
    turns.add("d", "d1")
    running["d1"] = 0
    assert [take() for _ in range(3)] == ["d1", "d1", "d1"]
    assert take() == "a1"  # a's three batches hold 3 together, as much as b, c and now d: back to the turns

    turns.remove("b", "b1")
    assert turns.next(lambda item: item.startswith("c"), running.__getitem__) == "c1"
    assert turns.next(lambda item: False, running.__getitem__) is None
