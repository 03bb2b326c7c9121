"""The running sequences' sampling state, one row each, kept across steps (vLLM v1's persistent input batch).

The model runner owns it, and keeps it in step with the scheduler (``update``): a sequence the scheduler started
(admitted, or forked) takes a row, one it stopped (finished, aborted, preempted) gives its row back, when the engine
passes them on: before a step runs, and once a step or an abort is over. A row's sampling parameters are written
once, into arrays the sampler reads for a step's rows with one gather; a penalised row's token counts live on the
device and grow by the tokens generated since the row's last step, instead of being rebuilt from the sequence's
whole token list.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ops.transfer import to_device
from ..request import GREEDY_BELOW, SamplingParams
from ..sequence import Sequence, Status
from .seeds import int64_bits

_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
"""float32 columns, in ``SamplingInputs.floats``' order."""


class BatchState:
    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 64) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.floats = np.zeros((len(_FLOATS), capacity), dtype=np.float32)
        self.top_k = np.zeros(capacity, dtype=np.int64)
        """``TOP_K_OFF`` where top-k is off (``0`` or ``-1``); the sampler caps it at the logits' width."""
        self.seed = np.zeros(capacity, dtype=np.int64)
        """The choice's seed, as the int64 with its 64 bits."""
        self.sampled = np.zeros(capacity, dtype=bool)
        """Temperature above 0 (else greedy)."""
        self.min_tokens = np.zeros(capacity, dtype=np.int64)
        self.prompt_len = np.zeros(capacity, dtype=np.int64)
        self.logprobs = np.zeros(capacity, dtype=bool)
        self.top_logprobs = np.zeros(capacity, dtype=np.int64)
        self.penalty_slot = np.full(capacity, -1, dtype=np.int64)
        """The row's place in ``counts``, or -1 (no penalty)."""
        self.counted = np.zeros(capacity, dtype=np.int64)
        """Generated tokens in the row's ``counts`` so far (penalised rows)."""
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * capacity
        """``logit_bias`` as (token ids, values)."""
        self.stop_ids: list[np.ndarray] = [_NO_IDS] * capacity
        """Tokens banned until ``min_tokens`` are generated (EOS and ``stop_token_ids``)."""
        self._free = list(range(capacity - 1, -1, -1))
        self.counts: torch.Tensor | None = None
        """``[slots, vocab]`` on the device: how often each token was generated, for penalised rows."""
        self.prompt_seen: torch.Tensor | None = None
        """``[slots, vocab]``: the prompt's tokens (the repetition penalty reads prompt and output)."""
        self._free_slots: list[int] = []
        self.using = {"bias": 0, "min_tokens": 0, "penalties": 0, "logprobs": 0, "sampled": 0}
        """How many rows use each feature: a step of rows that use none reads nothing for it (no per-step cost)."""

    @property
    def capacity(self) -> int:
        return len(self.top_k)

    def update(self, started: list[Sequence], stopped: list[Sequence]) -> None:
        """Follow the scheduler (``SchedulerOutput``): the sequences that stopped running give back their rows, then
        each that started and still runs takes one (since the last step a sequence may have stopped and started
        again, or started and stopped)."""
        for seq in stopped:
            if seq.row >= 0:
                self.remove(seq.row)
                seq.row = -1
        for seq in started:
            if seq.status is Status.RUNNING and seq.row < 0:
                state = seq.state
                request = state.request
                seq.row = self.add_row(
                    request.params, seq.seed, request.prompt_token_ids, seq.generated_ids, state.stop_token_ids
                )

    def add_row(
        self,
        params: SamplingParams,
        seed: int,
        prompt: list[int],
        generated: list[int],
        stop_ids: frozenset[int] = frozenset(),
    ) -> int:
        """A row for a sequence with these parameters, ``prompt`` and tokens ``generated`` so far."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.floats[:, row] = [getattr(params, name) for name in _FLOATS]
        self.top_k[row] = min(params.top_k, TOP_K_OFF) if params.top_k > 0 else TOP_K_OFF
        self.seed[row] = int64_bits(seed)
        self.sampled[row] = params.temperature >= GREEDY_BELOW
        self.min_tokens[row] = params.min_tokens
        self.prompt_len[row] = len(prompt)
        self.logprobs[row] = params.logprobs
        self.top_logprobs[row] = params.top_logprobs
        bias = params.logit_bias
        self.bias[row] = (np.fromiter(bias, np.int64), np.fromiter(bias.values(), np.float64)) if bias else None
        self.stop_ids[row] = np.fromiter(sorted(stop_ids), np.int64) if params.min_tokens else _NO_IDS
        self.penalty_slot[row] = self._take_slot(prompt, generated) if params.penalised else -1
        self.counted[row] = len(generated)
        self._tally(row, 1)
        return row

    def remove(self, row: int) -> None:
        self._tally(row, -1)
        if (slot := int(self.penalty_slot[row])) >= 0:
            self._free_slots.append(slot)
            self.penalty_slot[row] = -1
        self.bias[row] = None
        self._free.append(row)

    def _tally(self, row: int, change: int) -> None:
        using = self.using
        using["bias"] += change * (self.bias[row] is not None)
        using["min_tokens"] += change * bool(self.min_tokens[row])
        using["penalties"] += change * bool(self.penalty_slot[row] >= 0)
        using["logprobs"] += change * bool(self.logprobs[row])
        using["sampled"] += change * bool(self.sampled[row])

    def count_generated(self, seqs: list[Sequence]) -> None:
        """The tokens the penalised sequences ``seqs`` (each with a row) generated since their rows last counted."""
        slots: list[int] = []
        tokens: list[int] = []
        for seq in seqs:
            row, generated = seq.row, seq.num_generated
            counted = int(self.counted[row])
            if generated > counted:
                start = seq.num_prompt_tokens
                slots += [int(self.penalty_slot[row])] * (generated - counted)
                tokens += seq.token_ids[start + counted : start + generated]
                self.counted[row] = generated
        if slots:
            assert self.counts is not None
            index = to_device(torch.tensor([slots, tokens], dtype=torch.long), self.device)
            self.counts.index_put_((index[0], index[1]), _ONE.to(self.device), accumulate=True)

    def inputs(self, rows: list[int], positions: list[int], seeds: dict[int, int] | None = None) -> SamplingInputs:
        """What the sampler reads for a step's logits rows: the rows of the sequences sampled (a sequence whose
        prompt just completed has one per choice) and the position each samples at; ``seeds`` gives the logits rows
        whose seed is not their row's (the other choices of a prompt just completed)."""
        array = np.array(rows, dtype=np.int64)
        choice_seeds = self.seed[array]
        for index, seed in (seeds or {}).items():
            choice_seeds[index] = int64_bits(seed)
        return SamplingInputs(self, array, choice_seeds, np.array(positions, dtype=np.int64))

    def _take_slot(self, prompt: list[int], generated: list[int]) -> int:
        if not self._free_slots:
            self._grow_slots()
        assert self.counts is not None and self.prompt_seen is not None
        slot = self._free_slots.pop()
        self.counts[slot].zero_()
        self.prompt_seen[slot].zero_()
        if generated:
            ids = to_device(torch.tensor(generated, dtype=torch.long), self.device)
            self.counts[slot].index_put_((ids,), _ONE.to(self.device), accumulate=True)
        ids = to_device(torch.tensor(prompt, dtype=torch.long), self.device)
        self.prompt_seen[slot].index_fill_(0, ids, True)
        return slot

    def _grow(self) -> None:
        old = self.capacity
        new = old * 2
        self.floats = np.concatenate([self.floats, np.zeros_like(self.floats)], axis=1)
        for name in ("top_k", "seed", "sampled", "min_tokens", "prompt_len", "logprobs", "top_logprobs", "counted"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros_like(getattr(self, name))]))
        self.penalty_slot = np.concatenate([self.penalty_slot, np.full(old, -1, dtype=np.int64)])
        self.bias += [None] * old
        self.stop_ids += [_NO_IDS] * old
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    def _grow_slots(self) -> None:
        """Room for more penalised rows: ``[slots, vocab]`` doubles (the first penalised row makes 8)."""
        old = 0 if self.counts is None else self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.float32, device=self.device)
        seen = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        if self.counts is not None and self.prompt_seen is not None:
            counts[:old] = self.counts
            seen[:old] = self.prompt_seen
        self.counts, self.prompt_seen = counts, seen
        self._free_slots += range(new - 1, old - 1, -1)


_NO_IDS = np.zeros(0, dtype=np.int64)
TOP_K_OFF = 2**62
_ONE = torch.ones((), dtype=torch.float32)


@dataclass(slots=True)
class SamplingInputs:
    """One step's sampled rows, read from the batch state as arrays (built only for what the step needs)."""

    state: BatchState
    rows: np.ndarray
    """The batch row of each logits row."""
    seeds: np.ndarray
    """Each logits row's seed (int64 bit patterns): its choice's."""
    positions: np.ndarray
    """Each logits row's position: the index of the token it samples."""
    masks: tuple[np.ndarray, torch.Tensor] | None = None
    """The constrained logits rows and their grammars' token masks (packed bits), once filled."""

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def sampled(self) -> np.ndarray:
        """Logits rows drawn from a distribution (the rest are greedy)."""
        if not self.state.using["sampled"]:
            return _NO_IDS
        return np.flatnonzero(self.state.sampled[self.rows])

    @property
    def logprob_rows(self) -> np.ndarray:
        if not self.state.using["logprobs"]:
            return _NO_IDS
        return np.flatnonzero(self.state.logprobs[self.rows])

    @property
    def top_logprobs(self) -> np.ndarray:
        top: np.ndarray = self.state.top_logprobs[self.rows]
        return top

    def floats(self, at: np.ndarray | None = None) -> np.ndarray:
        """``[columns, rows]`` float32: temperature, top_p, min_p and the three penalties (of rows ``at``)."""
        floats: np.ndarray = self.state.floats[:, self.rows if at is None else self.rows[at]]
        return floats

    def top_k(self, at: np.ndarray) -> np.ndarray:
        top_k: np.ndarray = self.state.top_k[self.rows[at]]
        return top_k

    def bias(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``logit_bias`` of every row as (logits row, token, value), or ``None`` if no row has one."""
        if not self.state.using["bias"]:
            return None
        entries = [(i, *bias) for i, row in enumerate(self.rows) if (bias := self.state.bias[row]) is not None]
        if not entries:
            return None
        at = np.concatenate([np.full(len(tokens), i, dtype=np.int64) for i, tokens, _ in entries])
        return at, np.concatenate([t for _, t, _ in entries]), np.concatenate([v for _, _, v in entries])

    def banned(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(logits row, token) of the stop tokens banned until ``min_tokens`` are generated, or ``None``."""
        state = self.state
        if not state.using["min_tokens"]:
            return None
        short = np.flatnonzero(self.positions - state.prompt_len[self.rows] < state.min_tokens[self.rows])
        entries = [(i, state.stop_ids[self.rows[i]]) for i in short if len(state.stop_ids[self.rows[i]])]
        if not entries:
            return None
        return np.concatenate([np.full(len(ids), i, dtype=np.int64) for i, ids in entries]), np.concatenate(
            [ids for _, ids in entries]
        )

    def penalised(self) -> np.ndarray:
        """Logits rows with a penalty."""
        if not self.state.using["penalties"]:
            return _NO_IDS
        return np.flatnonzero(self.state.penalty_slot[self.rows] >= 0)

    def penalty_tables(self, at: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Token counts and prompt tokens of the penalised rows ``at``: ``[len(at), vocab]`` each, on the device."""
        state = self.state
        assert state.counts is not None and state.prompt_seen is not None
        slots = to_device(torch.from_numpy(state.penalty_slot[self.rows[at]]), state.device)
        return state.counts[slots], state.prompt_seen[slots]
