"""A batch's statuses and the one table of the moves between them; every status change goes through ``check``."""

from __future__ import annotations

TRANSITIONS: dict[str, frozenset[str]] = {
    "validating": frozenset({"in_progress", "failed", "expired", "cancelling"}),
    "in_progress": frozenset({"finalizing", "expired", "cancelling", "failed"}),
    "finalizing": frozenset({"completed", "failed"}),
    "cancelling": frozenset({"cancelled"}),
    "completed": frozenset(),
    "failed": frozenset(),
    "expired": frozenset(),
    "cancelled": frozenset(),
}
"""What each status may become. ``failed`` after validation means the server could not run the batch."""

CANCELLABLE = tuple(status for status, moves in TRANSITIONS.items() if "cancelling" in moves)


class InvalidTransition(RuntimeError):
    """A status change the table does not allow: a bug in the caller."""


def check(current: str, new: str) -> None:
    if new not in TRANSITIONS[current]:
        raise InvalidTransition(f"a batch cannot go from {current!r} to {new!r}")


def timestamp_column(status: str) -> str:
    """The batch field that records when it entered ``status`` (``in_progress_at``...)."""
    return f"{status}_at"
