"""What the scheduler decided for one step (vLLM v1's ``SchedulerOutput``): the sequences that run and how many new
tokens each computes, and the sequences that started or stopped running since its last report, so that the model
runner's batch state follows them (``batch_state.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from .sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int
    """New tokens computed this step, from ``seq.num_computed_tokens``."""


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    started: list[Sequence]
    """Sequences that began to run since the last report: admitted (again, after a preemption) or forked."""
    stopped: list[Sequence]
    """Sequences that stopped running since the last report: finished, aborted or preempted. A sequence may be in both
    lists, in either order."""
