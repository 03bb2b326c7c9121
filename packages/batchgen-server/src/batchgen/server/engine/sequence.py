"""One sequence being generated (a choice of a request), and the request state that owns its choices."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from .request import EngineRequest, FinishReason, TokenLogprob
from .sampling.detokenizer import IncrementalDetokenizer
from .sampling.seeds import mix64

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
    pooled: torch.Tensor | None = None
    """An ``embed`` request's prompt pooled so far (``pooling.Pooler``)."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One per prompt token (``None`` for the first), filled as its chunks run, where the request asks for them."""
    arrival: float = field(default_factory=time.time)
    scheduled: float | None = None
    first_token: float | None = None

    reads_cache_when_pooled: bool = False
    """An ``embed`` request's prompt may start from the prefix cache: its model pools the last token alone (mean or
    first-token pooling needs every position's hidden state, which a cached token does not have)."""

    @property
    def salt(self) -> int:
        """What its prompt's KV blocks are hashed from, besides their tokens: its LoRA adapter's salt (0: the base)."""
        return self.request.lora.salt if self.request.lora is not None else 0

    def reads_prefix_cache(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prompt may start from cached blocks: not where every prompt position must be computed
        (mean pooling, prompt logprobs)."""
        if self.request.task == "embed":
            return self.reads_cache_when_pooled
        return not self.wants_prompt_logprobs(seq)

    @property
    def finished(self) -> bool:
        return all(seq.status is Status.FINISHED for seq in self.seqs)

    def wants_prompt_logprobs(self, seq: Sequence) -> bool:
        """Whether ``seq`` still owes the prompt's logprobs: the request asks for them, ``seq`` holds the prompt (not a
        fork) and its first token is not out yet (after that every prompt position has been scored)."""
        return self.prompt_logprobs is not None and not seq.forked and seq.index == 0 and self.first_token is None

    def choice_seed(self, index: int) -> int:
        """Choice ``index`` samples from ``mix64(seed, index)``: the same draws whatever else runs beside it."""
        return mix64(self.seed, index)

    def new_sequence(self, token_ids: list[int], index: int, tokenizer: Any) -> Sequence:
        """Choice ``index`` (0 holds the prompt; the others fork from it), with a detokenizer where stop strings or
        a stream need its text as it grows, and a place for its logprobs where asked."""
        params = self.request.params
        detokenizer = None
        if params.stop or self.request.stream:
            detokenizer = IncrementalDetokenizer(tokenizer, params.stop, params.skip_special_tokens)
        logprobs: list[TokenLogprob] | None = [] if params.logprobs else None
        prompt = len(self.request.prompt_token_ids)
        return Sequence(self, token_ids, prompt, index, self.choice_seed(index), detokenizer, logprobs=logprobs)


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
    row: int = -1
    """Its row in the model runner's ``BatchState`` (its sampling state) while it runs (``BatchState.update``); ``-1``
    otherwise."""
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
    matcher: Any = None
    """Its grammar's llguidance matcher (``None``: unconstrained), advanced by each committed token once active."""
    grammar_active: bool = True
    """The grammar constrains its next token (``False`` while a reasoning model still thinks)."""

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

    def last_by_length(self, index: int) -> bool:
        """Whether the token at ``index`` is its last by ``max_tokens`` or the context cap."""
        return index + 1 - self.num_prompt_tokens >= self.state.max_tokens or index + 1 >= self.state.max_len
