"""Requests that take the whole process down: a journal of what is inside the engine, read back at the next start.

The engine itself fails a request that breaks a step, and its worker restarts it after worse (engine/worker.py);
this covers what kills the process (a crash in native code, the OOM killer). The batch loop notes each request line
when it enters the engine (``+``) and when it leaves it: answered (``-``, its strikes forgotten), or not (``~``:
cancelled, expired, sent back after a storage fault; its strikes kept). One JSON array per journal line, without
fsync (the page cache outlives the process). At start, a line entered and never left was inside the engine when the
process died, and gets a strike (``!`` records, kept until the line is answered). ``strikes`` applies the policy of
``engine.strikes`` to them (``quarantine`` is how the loop asks it): a line with two is answered with a
``server_error`` line instead of run, so one request can never keep a server in a crash loop.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..engine.strikes import Strikes

log = logging.getLogger("batchgen.server.loop")

COMPACT_BYTES = 16 * 2**20
"""Past this size the journal is rewritten with only what is still open."""

Key = tuple[str, str]
"""(batch id, custom_id)."""


class CrashJournal:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.strikes: Strikes[Key] = Strikes()
        self._inside: set[Key] = set()
        self._recover()
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the loop's lifetime)
        self._failing = False

    def _recover(self) -> None:
        if not self.path.exists():
            return
        inside: dict[Key, None] = {}
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                mark, batch_id, custom_id, *count = json.loads(line)
            except ValueError:
                continue  # a line cut short when the process died
            key = (batch_id, custom_id)
            if mark == "!":
                self.strikes.counts[key] = count[0]
            elif mark == "+":
                inside[key] = None
            elif mark == "-":
                inside.pop(key, None)
                self.strikes.counts.pop(key, None)
            elif mark == "~":
                inside.pop(key, None)
        self.strikes.strike(inside)
        if inside:
            log.warning("the last run stopped with %d request(s) inside the engine: each gets a strike", len(inside))
        self._rewrite()

    def entered(self, batch_id: str, custom_id: str) -> None:
        self._inside.add((batch_id, custom_id))
        self._append("+", batch_id, custom_id)

    def answered(self, batch_id: str, custom_id: str) -> None:
        key = (batch_id, custom_id)
        if key in self._inside or self.strikes.struck(key):
            self._inside.discard(key)
            self._append("-", batch_id, custom_id)
        self.strikes.left(key, forget=True)

    def dropped(self, batch_id: str, custom_id: str) -> None:
        """The line left the engine (or its way in) unanswered: cancelled, expired, or to be tokenized again after a
        storage fault. Not a suspect; its strikes stay."""
        key = (batch_id, custom_id)
        if key in self._inside:
            self._inside.discard(key)
            self._append("~", batch_id, custom_id)
        self.strikes.left(key, forget=False)

    def close(self) -> None:
        """A clean stop: what is inside the engine now is not a suspect."""
        self._inside.clear()
        try:
            self._file.close()
            self._rewrite()
        except OSError as exc:
            log.warning("the crash journal could not be closed cleanly (%s)", exc)

    def _append(self, *record: object) -> None:
        """Advisory: a full disk must not cost an answer, so a failed write is logged, never raised (a line it cut
        short is skipped when read back)."""
        try:
            if self._file.closed:  # reopening it after a compaction failed (no descriptor left, say)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            if self._file.tell() > COMPACT_BYTES:
                self._file.close()
                self._rewrite()
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            if not self._failing:
                log.warning("the crash journal could not be written (%s): a crash now is not pinned on a request", exc)
            self._failing = True
        else:
            self._failing = False

    def _rewrite(self) -> None:
        struck = [("!", b, c, n) for (b, c), n in self.strikes.counts.items()]
        records = struck + [("+", b, c) for b, c in self._inside]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
        tmp.replace(self.path)
