"""The crash journal's strikes as the batch loop applies them to request lines (the policy: ``engine.strikes``; the
record: ``crashes``): a line with two strikes is answered instead of run, a struck line waits while another is on
probation (from when it is taken to be tokenized until it leaves the engine), and each line's way into the engine and
out is noted, so that a death of the process is pinned on what was inside. Without a journal (run-batch) nothing is
noted and no line is struck."""

from __future__ import annotations

from ..engine.strikes import Strikes
from .crashes import CrashJournal, Key


class Quarantine:
    def __init__(self, journal: CrashJournal | None) -> None:
        self.journal = journal
        self._strikes: Strikes[Key] = Strikes() if journal is None else journal.strikes

    def quarantined(self, batch_id: str, custom_id: str) -> bool:
        return self._strikes.quarantined((batch_id, custom_id))

    def waits(self, batch_id: str, custom_id: str) -> bool:
        """The line is struck and another is on probation: it is not taken until that one has left."""
        return self._strikes.waits((batch_id, custom_id))

    def taken(self, batch_id: str, custom_id: str) -> None:
        """The line is taken to be tokenized, then run: on probation if it is struck."""
        self._strikes.entered((batch_id, custom_id))

    def entered(self, batch_id: str, custom_id: str) -> None:
        """The line goes into the engine."""
        if self.journal is not None:
            self.journal.entered(batch_id, custom_id)

    def left(self, batch_id: str, custom_id: str, *, answered: bool) -> None:
        """The line left the window, ``answered`` or not (cancelled, expired, sent back after a storage fault)."""
        if self.journal is None:
            return
        if answered:
            self.journal.answered(batch_id, custom_id)
        else:
            self.journal.dropped(batch_id, custom_id)

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
