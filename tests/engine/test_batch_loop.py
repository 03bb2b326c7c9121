"""The batch loop's order of turns (tenants, then their batches), and its table of status moves."""

from __future__ import annotations

from batchgen.schemas import ACTIVE_STATUSES, STATUSES, TERMINAL_STATUSES
from batchgen.server.batches import lifecycle
from batchgen.server.batches.turns import Turns


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


def test_the_transition_table_covers_the_schemas_statuses() -> None:
    """Every status the wire knows has its moves; the active ones (that the loop resumes) are those that move on."""
    assert set(lifecycle.TRANSITIONS) == set(STATUSES)
    assert {status for status, moves in lifecycle.TRANSITIONS.items() if moves} == set(ACTIVE_STATUSES)
    assert set(STATUSES) - set(ACTIVE_STATUSES) == TERMINAL_STATUSES
