"""The crash journal on its own: what counts as inside the engine at a death, strikes, clean stops, torn lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen.server.batches import crashes
from batchgen.server.batches.crashes import CrashJournal


def test_lines_inside_at_a_death_get_a_strike_and_clean_stops_give_none(tmp_path: Path) -> None:
    path = tmp_path / "inflight.journal"
    journal = CrashJournal(path)
    for custom_id in ("a", "b", "c", "d"):
        journal.entered("batch", custom_id)
    journal.answered("batch", "a")
    journal.dropped("batch", "b")  # cancelled: left unanswered, not a suspect
    del journal  # the process dies: no close()
    after_death = CrashJournal(path)
    assert dict(after_death.strikes.counts) == {("batch", "c"): 1, ("batch", "d"): 1}
    after_death.entered("batch", "c")
    after_death.close()  # a clean stop: what is inside now is no suspect, the strikes stay
    assert dict(CrashJournal(path).strikes.counts) == {("batch", "c"): 1, ("batch", "d"): 1}


def test_a_second_death_adds_a_strike_and_an_answer_clears_it(tmp_path: Path) -> None:
    path = tmp_path / "inflight.journal"
    first = CrashJournal(path)
    first.entered("b1", "x y\nz")  # custom_ids may hold spaces and newlines
    first.entered("b1", "w")
    second = CrashJournal(path)
    second.entered("b1", "x y\nz")
    third = CrashJournal(path)
    assert third.strikes.counts[("b1", "x y\nz")] == 2 and third.strikes.counts[("b1", "w")] == 1
    third.answered("b1", "w")
    third.close()
    assert dict(CrashJournal(path).strikes.counts) == {("b1", "x y\nz"): 2}


def test_a_struck_line_dropped_unanswered_keeps_its_strike_across_a_restart(tmp_path: Path) -> None:
    """Cancelled (or sent back) after its strike: out of the engine, still a suspect at the next start."""
    path = tmp_path / "inflight.journal"
    CrashJournal(path).entered("b", "suspect")  # the process dies with it inside: a strike
    journal = CrashJournal(path)
    journal.entered("b", "suspect")
    journal.dropped("b", "suspect")
    del journal  # and dies again, the line out of the engine
    assert dict(CrashJournal(path).strikes.counts) == {("b", "suspect"): 1}


def test_a_line_torn_by_the_death_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "inflight.journal"
    journal = CrashJournal(path)
    journal.entered("b", "kept")
    with path.open("a") as file:
        file.write('["+", "b", "to')  # the death cut this write short
    assert dict(CrashJournal(path).strikes.counts) == {("b", "kept"): 1}


def test_the_journal_is_compacted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(crashes, "COMPACT_BYTES", 400)
    path = tmp_path / "inflight.journal"
    journal = CrashJournal(path)
    for i in range(100):
        journal.entered("b", f"r{i}")
        journal.answered("b", f"r{i}")
    journal.entered("b", "open")
    assert path.stat().st_size < 400
    del journal
    assert dict(CrashJournal(path).strikes.counts) == {("b", "open"): 1}


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a device that is always full")
def test_a_full_disk_costs_the_journal_a_warning_never_an_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The journal is advisory: the batch loop notes a request leaving the engine after answering it, and a write
    that fails (ENOSPC) must not raise into the loop, where it would drop the answer."""
    journal = CrashJournal(tmp_path / "inflight.journal")
    journal._file.close()
    journal._file = open("/dev/full", "a", encoding="utf-8")  # noqa: SIM115 (every write fails with ENOSPC)
    journal.entered("batch", "a")
    journal.answered("batch", "a")
    journal.entered("batch", "b")
    warnings = [record for record in caplog.records if "crash journal could not be written" in record.message]
    assert len(warnings) == 1  # once while it keeps failing, not per line
    journal.close()
