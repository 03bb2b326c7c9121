"""What a step costs, learned from the steps the engine runs, and the prefill tokens a step that carries online
requests' decodes may take: so that a prompt arriving beside streams delays their next token by about a bounded
factor (``--max-mixed-step-ratio``) instead of a whole chunk's compute (Sarathi-Serve's stall-free batching, with
the token budget found from measured costs rather than profiled offline).

vLLM bounds the same thing by a token count (``long_prefill_token_threshold``, a request's chunk); what a token costs
beside a decode differs by a factor of a hundred between a GPU (prefill tokens nearly free next to reading the
weights) and a CPU (every token is compute): a count right for one device and model is wrong for another. So the
bound is a time, and the token count follows from costs measured as steps run:

- a step of ``d`` decodes alone takes ``a + b * d`` (a weighted least-squares line over recent decode-only steps),
  and
- a prefill token adds ``token`` to a step (its time less its decodes', over its prefill tokens).

The reference is the decode step the streams will see once the prompts now waiting run too (``expected`` decodes:
the running and waiting sequences, up to ``--max-num-seqs``): a step of ``d`` decodes takes the prefill tokens that
fill ``ratio`` times that step, less its own decodes' time, at least ``floor``. With a full running set a step costs
about ``ratio`` times a decode step; with a few streams and many prompts waiting (a burst of arrivals) the prompts
move faster, as they would delay few streams by less than the stall the full set will see anyway. Until the costs
are measured, nothing is bounded (the first steps measure them). A step's time is its ``LLMEngine.step`` call: exact
when steps run one at a time (CPU), one step off under async scheduling, where the bound is loose anyway.

A sample counts at most ``OUTLIER`` times what the costs predict: a step stalled by a compilation, a garbage
collection or another process says nothing of the next one's cost, and taken whole it widened the bound for dozens
of steps (the first wave of a served run had steps of 2x a decode step under a 1.25 bound); a lasting change still
gets through, if a few steps later (a tenfold prefill token cost is 90% learned in 8 steps rather than 7). And the
decode line starts again from a step under a ``1 / OUTLIER`` of its prediction: the line was inflated by a stalled
step taken whole (the first one measured, which nothing clips). A too large line loosens the bound; a too large
token cost only tightens it for a few steps (prompts move slower, by a block a step at least), so that one is left
to its average. Errors are meant to fall on that side: past the widest decode step measured, a step is taken to
cost what that one did, less than it will on a CPU, where a step's cost grows with its decodes."""

from __future__ import annotations

from collections.abc import Iterable

from ..scheduler_output import ScheduledSeq

SMOOTHING = 0.3
"""Weight of the newest step in each moving average: a few steps' noise (another process on the core) moves the
bound by a fraction, a lasting change (a longer context) within ten steps or so."""

OUTLIER = 3.0
"""A sample counts as at most this many times its prediction."""

MIN_PREFILL_SAMPLE = 16
"""Steps with fewer prefill tokens say little of a token's cost (the step's own noise dominates): not counted."""


class StepCosts:
    def __init__(self, ratio: float, floor: int) -> None:
        """``ratio``: a step carrying streamed decodes costs at most about this many times a usual decode step
        (``<= 1``: no bound); ``floor``: it may take at least this many prefill tokens, so that a prompt beside
        streams still moves at a useful pace."""
        self.ratio = ratio
        self.floor = floor
        self.prefill_token_s: float | None = None
        """Seconds a prefill token adds to a step."""
        self._line = [0.0] * 5
        """Decayed sums over decode-only steps of 1, d, d^2, t, d * t (``d`` decodes in ``t`` seconds)."""
        self._widest = 0
        """The most decodes a decode-only step has had: past it the line is not trusted."""

    @property
    def bounds(self) -> bool:
        """Whether a step can be bounded: on, and both costs measured."""
        return self.ratio > 1 and bool(self._line[0]) and bool(self.prefill_token_s)

    def observe(self, seconds: float, scheduled: Iterable[ScheduledSeq]) -> None:
        """A step ran ``scheduled`` in ``seconds`` (not counted when the bound is off: nothing would read it)."""
        if self.ratio <= 1:
            return
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
            if self._line[0]:
                predicted = self.decodes_s(decodes)
                if seconds * OUTLIER < predicted:
                    self._restart_line()
                seconds = min(seconds, OUTLIER * predicted)
            keep = 1 - SMOOTHING / 4  # the line remembers more steps than the average: it needs a spread of sizes
            for i, term in enumerate((1.0, decodes, decodes * decodes, seconds, decodes * seconds)):
                self._line[i] = keep * self._line[i] + term
            self._widest = max(self._widest, decodes)
        elif prefill >= MIN_PREFILL_SAMPLE and (self._line[0] or not decodes):
            per_token = max(seconds - self.decodes_s(decodes), 0.0) / prefill
            if self.prefill_token_s is not None:
                per_token = min(per_token, OUTLIER * self.prefill_token_s)
            self.prefill_token_s = _average(self.prefill_token_s, per_token)

    def forget(self) -> None:
        """Drop what was measured: the steps so far were not serving's (the load-time self-check's: compilations,
        logprobs, a small token budget)."""
        self.prefill_token_s = None
        self._restart_line()

    def _restart_line(self) -> None:
        self._line, self._widest = [0.0] * 5, 0

    def decodes_s(self, decodes: int) -> float:
        """Seconds ``decodes`` decodes take in a step of their own (0 when none was measured); past the most
        measured, what that took: a decode step's cost is mostly reading the weights, whatever the count (taken
        proportional, one warm-up stream's step made sixteen streams' 10x too long, and the bound let in prompts of
        twice a decode step's cost)."""
        n, sd, sdd, st, sdt = self._line
        if not n or not decodes:
            return 0.0
        if decodes > self._widest:
            return self.decodes_s(self._widest)
        mean_d, mean_t = sd / n, st / n
        spread = sdd / n - mean_d * mean_d
        if spread >= 0.5:  # steps of different sizes: the line
            slope = (sdt / n - mean_d * mean_t) / spread
            fixed = mean_t - slope * mean_d
            if slope > 0 and fixed >= 0:
                return fixed + slope * decodes
        return mean_t * decodes / mean_d  # one size (or a line off by noise): proportional

    def prefill_budget(self, decodes: int, expected: int) -> int | None:
        """The most prefill tokens a step of ``decodes`` decodes may take, ``expected`` decodes being what the
        running set will decode once the waiting prompts join; ``None``: no bound (off, or the costs are not measured
        yet)."""
        if not self.bounds:
            return None
        assert self.prefill_token_s is not None
        room = self.ratio * self.decodes_s(max(decodes, expected)) - self.decodes_s(decodes)
        return max(self.floor, int(room / self.prefill_token_s))


def _average(mean: float | None, sample: float) -> float:
    return sample if mean is None else mean + SMOOTHING * (sample - mean)
