"""What a step costs, learned from the steps the engine runs, and the prefill tokens a step that carries online
requests' decodes may take: so that a prompt arriving beside streams delays their next token by at most a bounded
factor (``--max-mixed-step-ratio``), instead of a whole chunk's worth of compute.

vLLM bounds the same thing by a token count (``long_prefill_token_threshold``, a request's chunk); what a token
costs beside a decode differs by a factor of a hundred between a GPU (prefill tokens nearly free next to reading the
weights) and a CPU (every token is compute): a count right for one device is wrong for the other. So the bound is a
ratio of times, and the token count follows from two costs measured as steps run:

- a decode's share of a step of decodes alone (its time over its decodes), and
- what a prefill token adds to a step (the step's time less its decodes' share, over its prefill tokens).

A step of ``d`` decodes may then take ``(ratio - 1) * d * decode / token`` prefill tokens (at least ``floor``), so that
it costs about ``ratio`` times the same decodes alone. Until both costs are measured a step is not bounded (the first
steps measure them; the self-check at load runs such steps). A step's time is its ``LLMEngine.step`` call: exact when
steps run one at a time (CPU), one step off under async scheduling, where the bound is loose anyway."""

from __future__ import annotations

from collections.abc import Iterable

from .scheduler_output import ScheduledSeq

SMOOTHING = 0.2
"""Weight of the newest step in each moving average: a few steps' noise (another process on the core) moves the
bound by a fraction, a lasting change (a longer context) within ten steps or so."""

MIN_PREFILL_SAMPLE = 16
"""Steps with fewer prefill tokens say little of a token's cost (the step's own noise dominates): not counted."""


class StepCosts:
    def __init__(self, ratio: float, floor: int) -> None:
        """``ratio``: a step carrying streamed decodes costs at most about this many times the same decodes alone
        (``<= 1``: no bound); ``floor``: it may take at least this many prefill tokens, so that a prompt beside
        streams still moves at a useful pace."""
        self.ratio = ratio
        self.floor = floor
        self.decode_s: float | None = None
        """Seconds a decode takes, its share of a step of decodes alone."""
        self.prefill_token_s: float | None = None
        """Seconds a prefill token adds to a step."""

    def observe(self, seconds: float, scheduled: Iterable[ScheduledSeq]) -> None:
        """A step ran ``scheduled`` in ``seconds``."""
        decodes = prefill = 0
        for item in scheduled:
            if item.num_tokens == 1:
                decodes += 1
            else:
                prefill += item.num_tokens
        self.record(seconds, decodes, prefill)

    def record(self, seconds: float, decodes: int, prefill: int) -> None:
        """A step of ``decodes`` decodes and ``prefill`` prefill tokens took ``seconds``."""
        if decodes and not prefill:
            self.decode_s = _average(self.decode_s, seconds / decodes)
        elif prefill >= MIN_PREFILL_SAMPLE and (self.decode_s is not None or not decodes):
            spent = seconds - (self.decode_s or 0.0) * decodes
            self.prefill_token_s = _average(self.prefill_token_s, max(spent, 0.0) / prefill)

    def prefill_budget(self, decodes: int) -> int | None:
        """The most prefill tokens a step of ``decodes`` streamed decodes may take; ``None``: no bound (off, or the
        costs are not measured yet)."""
        if self.ratio <= 1 or self.decode_s is None or not self.prefill_token_s:
            return None
        return max(self.floor, int((self.ratio - 1) * decodes * self.decode_s / self.prefill_token_s))


def _average(mean: float | None, sample: float) -> float:
    return sample if mean is None else mean + SMOOTHING * (sample - mean)
