"""A step launched on the device and not yet settled: what the model runner hands the engine, and what the output
processor commits once the step's tokens are read back (vLLM v1's model runner output, left in flight)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling.prompt_logprobs import PromptLogprobs
from ..sampling.sampler import Sampled
from ..scheduler_output import ScheduledSeq
from ..sequence import Sequence


@dataclass(slots=True)
class Launched:
    scheduled: list[ScheduledSeq]
    choices: list[int] = field(default_factory=list)
    """Tokens sampled for each scheduled sequence: 0 (a prefill chunk short of the prompt's end, an embedding), 1,
    or ``n`` when the prompt just completed (its choices fork from it)."""
    first_blocks: list[int] = field(default_factory=list)
    """Each sequence's first block not full before the step: where publishing full blocks resumes."""
    token_indices: list[int] = field(default_factory=list)
    """Each sequence's index of the token the step samples (``PENDING`` there until settled)."""
    token_rows: dict[Sequence, int] = field(default_factory=dict)
    """Row of ``sampled.tokens`` each sampled sequence takes its next input from."""
    overlappable: bool = True
    """Whether the next step may be scheduled and launched before this one is settled (with async scheduling)."""
    hidden: torch.Tensor | None = None
    sampled: Sampled | None = None
    prompt: PromptLogprobs | None = None
    """The prompt logprobs the step scored, where a chunk of a request that asks for them ran."""
