"""One sequence being generated (a choice of a request), and the request state that owns its choices."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from .detokenizer import IncrementalDetokenizer
from .request import EngineRequest, FinishReason, TokenLogprob

PENDING = -1
"""The token id a sequence holds, at its end, for a token sampled on the device that the host has not read yet (a
step that is still running: ``engine.py``). The next step's input takes it from the device."""


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class RequestState:
    """Everything the engine tracks for one request: its choices, limits and accumulated results."""

    request: EngineRequest
    max_len: int
    """Prompt + generated tokens never exceed this (the context cap)."""
    max_tokens: int
    """Most generated tokens per choice."""
    stop_token_ids: frozenset[int]
    seed: int
    """The request's ``seed``, or one drawn for it: each choice samples from ``mix64(seed, choice index)``."""
    seqs: list[Sequence] = field(default_factory=list)
    cached_tokens: int = 0
    embedding_sum: torch.Tensor | None = None
    arrival: float = field(default_factory=time.time)
    scheduled: float | None = None
    first_token: float | None = None

    @property
    def finished(self) -> bool:
        return all(seq.status is Status.FINISHED for seq in self.seqs)


@dataclass(eq=False)
class Sequence:
    state: RequestState
    token_ids: list[int]
    num_prompt_tokens: int
    index: int = 0
    """The choice index (0..n-1)."""
    seed: int = 0
    """This choice's sampling seed."""
    detokenizer: IncrementalDetokenizer | None = None
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache; the rest are computed by the next steps."""
    block_table: list[int] = field(default_factory=list)
    """The cache blocks holding its tokens, in order; changed only through the block manager's ``BlockTables``."""
    table_row: int = -1
    """Its row in ``BlockTables.array`` (``-1`` while it holds no blocks)."""
    block_hashes: list[int] = field(default_factory=list)
    """Content hashes of the full blocks, in order (filled lazily, kept across preemption)."""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    forked: bool = False
    """``True`` once the n choices have been forked from this sequence (or for a fork itself)."""
    streamed_tokens: int = 0
    """Generated tokens reported in partial results so far (streamed requests)."""
    streamed_chars: int = 0
    """Characters of the text reported in partial results so far."""

    def __len__(self) -> int:
        """Tokens so far, a pending one included."""
        return len(self.token_ids)

    @property
    def pending(self) -> bool:
        """Whether the last token is still on the device (``PENDING``)."""
        return self.token_ids[-1] == PENDING

    def put(self, index: int, token_id: int) -> None:
        """A sampled token at ``index``: where its step left ``PENDING``, or next (nothing was left there: the step
        knew the token would be the last)."""
        if index == len(self.token_ids):
            self.token_ids.append(token_id)
        else:
            self.token_ids[index] = token_id

    @property
    def num_generated(self) -> int:
        """Generated tokens the host has read."""
        return len(self.token_ids) - self.num_prompt_tokens - self.pending

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens : len(self.token_ids) - self.pending]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
