"""Pick the next token of every sampled row at once, on the model's device, with one transfer to the host.

Every row's work is one batched tensor computation: the logit bias, ``min_tokens``, the penalties, greedy, temperature,
``min_p``, top-k and top-p apply to all rows together, whatever their mix of parameters.

Sampling is stateless: each row draws one uniform number from a hash of (its seed, the token's position), computed
on the device (splitmix64 in 64-bit integer arithmetic), and takes the token where it falls in the cumulative
distribution (inverse-CDF sampling, exactly the categorical distribution). So the same seed and input give the same
tokens whatever else shares the batch, and a step that is computed again (after a fault, say) samples exactly what it
would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .request import SamplingParams, TokenLogprob

_MASK64 = 2**64 - 1
_GOLDEN, _MUL1, _MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix64(*values: int) -> int:
    """splitmix64 over the values in turn: a well-spread 64-bit hash."""
    state = 0
    for value in values:
        state = (state + (value & _MASK64) + _GOLDEN) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
        z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
        state = z ^ (z >> 31)
    return state


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that depends only on ``seed`` and ``position``."""
    return (mix64(seed, position) >> 11) / 2**53


def _signed(value: int) -> int:
    """The int64 with the same 64 bits."""
    return value - 2**64 if value >= 2**63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 bit patterns (torch's ``>>`` is arithmetic on signed integers)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``uniform`` for every row at once: int64 tensors in (bit patterns of the 64-bit seeds), float64 out.
    Integer multiplication and addition wrap modulo 2**64 on every torch device, which is what splitmix64 needs."""
    state = torch.zeros_like(seeds)
    for value in (seeds, positions):
        z = state + value + _signed(_GOLDEN)
        z = (z ^ _shift_right(z, 30)) * _signed(_MUL1)
        z = (z ^ _shift_right(z, 27)) * _signed(_MUL2)
        state = z ^ _shift_right(z, 31)
    return _shift_right(state, 11).double() / 2**53


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    seed: int
    """The choice's own seed (the request's, mixed with the choice index)."""
    position: int
    """Position of the token being sampled in its sequence."""
    token_ids: list[int]
    """The sequence's tokens so far (not copied: read for penalties and ``min_tokens``)."""
    num_prompt_tokens: int
    """``token_ids[num_prompt_tokens:]`` are the generated ones."""
    stop_token_ids: frozenset[int] = frozenset()
    """Tokens that end the sequence (its EOS ids, ``stop_token_ids``): banned until ``min_tokens`` are generated."""

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """``logits`` is ``[rows, vocab]``; returns the chosen token ids and, where asked, their logprobs."""
        logits = self.process(logits.float(), rows)
        chosen = self.choose(logits, rows)
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs]
        if not wanted:
            return chosen.tolist(), [None] * len(rows)  # the step's one transfer to the host
        k = min(max(rows[i].params.top_logprobs for i in wanted), logits.shape[1])
        index = torch.tensor(wanted, device=logits.device)
        log_probs = torch.log_softmax(logits[index], dim=-1)
        chosen_lp = log_probs.gather(1, chosen[index].unsqueeze(1))
        top_lp, top_ids = log_probs.topk(k, dim=-1)
        packed = torch.cat(
            [chosen.double(), chosen_lp.double().flatten(), top_lp.double().flatten(), top_ids.double().flatten()]
        )
        host = packed.tolist()  # the step's one transfer to the host: token ids are exact in float64
        token_ids = [int(t) for t in host[: len(rows)]]
        chosen_list = host[len(rows) : len(rows) + len(wanted)]
        top_lp_list = host[len(rows) + len(wanted) : len(rows) + len(wanted) * (1 + k)]
        top_ids_list = host[len(rows) + len(wanted) * (1 + k) :]
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        for j, i in enumerate(wanted):
            n = rows[i].params.top_logprobs
            top = tuple(
                (int(token), lp)
                for token, lp in zip(top_ids_list[j * k : j * k + n], top_lp_list[j * k : j * k + n], strict=True)
            )
            logprobs[i] = TokenLogprob(token_ids[i], chosen_list[j], top)
        return token_ids, logprobs

    @staticmethod
    def process(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The logits every later stage sees (and the logprobs report): logit bias, ``min_tokens``, then the
        penalties, in vLLM's order."""
        device = logits.device
        biased = [(i, token, bias) for i, r in enumerate(rows) for token, bias in r.params.logit_bias.items()]
        if biased:
            rows_t, tokens_t, biases = zip(*biased, strict=True)
            index = (torch.tensor(rows_t, device=device), torch.tensor(tokens_t, device=device))
            logits = logits.index_put(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)
        banned = [(i, t) for i, r in enumerate(rows) if r.num_generated < r.params.min_tokens for t in r.stop_token_ids]
        if banned:
            index = tuple(torch.tensor(column, device=device) for column in zip(*banned, strict=True))
            logits = logits.index_put(index, torch.tensor(float("-inf"), device=device))
        penalised = [i for i, r in enumerate(rows) if _has_penalties(r.params)]
        if penalised:
            logits = logits.clone() if not (biased or banned) else logits
            logits[penalised] = _penalties(logits[penalised], [rows[i] for i in penalised])
        return logits

    @staticmethod
    def choose(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The chosen token of every row: argmax for greedy rows, a draw from the filtered distribution otherwise."""
        sampled = [i for i, r in enumerate(rows) if r.params.temperature > 0]
        if not sampled:
            return logits.argmax(dim=-1)
        if len(sampled) == len(rows):
            return _sample(logits, rows)
        chosen = logits.argmax(dim=-1)
        chosen[sampled] = _sample(logits[sampled], [rows[i] for i in sampled])
        return chosen


def _has_penalties(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


def _flat(lists: Sequence[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index and token id of every element of ``lists``, as two flat tensors."""
    row_ids = [row for row, ids in enumerate(lists) for _ in range(len(ids))]
    tokens = [token for ids in lists for token in ids]
    return torch.tensor(row_ids, dtype=torch.long, device=device), torch.tensor(tokens, dtype=torch.long, device=device)


def _penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """vLLM's repetition penalty over prompt and output tokens (divide a positive logit, multiply a negative one),
    then OpenAI's ``logit - count * frequency - (count > 0) * presence`` over the output tokens."""
    device = logits.device
    column = lambda values: torch.tensor(values, dtype=logits.dtype, device=device).unsqueeze(1)  # noqa: E731
    counts = torch.zeros_like(logits)
    counts.index_put_(_flat([r.generated_ids for r in rows], device), torch.ones((), device=device), accumulate=True)
    repetition = column([r.params.repetition_penalty for r in rows])
    if bool((repetition != 1.0).any()):
        seen = counts > 0
        seen[_flat([r.token_ids[: r.num_prompt_tokens] for r in rows], device)] = True
        scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, scaled, logits)
    frequency = column([r.params.frequency_penalty for r in rows])
    presence = column([r.params.presence_penalty for r in rows])
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


def _sample(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, then ``min_p`` (drop tokens less likely than ``min_p`` times the likeliest), top-k and top-p
    on one sorted copy, then the inverse-CDF draw."""
    device, vocab = logits.device, logits.shape[1]
    column = lambda values: torch.tensor(values, device=device).unsqueeze(1)  # noqa: E731
    logits = logits / column([r.params.temperature for r in rows]).to(logits.dtype)
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    min_p = column([r.params.min_p for r in rows]).to(logits.dtype)
    # p < min_p * p_max  <=>  logit < max logit + log(min_p); log(0) = -inf keeps everything.
    dropped = sorted_logits < sorted_logits[:, :1] + torch.log(min_p)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    top_k = column([min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in rows])
    probs = sorted_logits.masked_fill(dropped | (ranks >= top_k), float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    top_p = column([r.params.top_p for r in rows]).to(probs.dtype)
    probs = probs.masked_fill((probs.cumsum(dim=-1) - probs) >= top_p, 0.0)
    cdf = probs.double().cumsum(dim=-1)
    seeds = torch.tensor([_signed(r.seed & _MASK64) for r in rows], dtype=torch.long, device=device)
    positions = torch.tensor([r.position for r in rows], dtype=torch.long, device=device)
    draws = uniforms(seeds, positions)
    index = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(1), right=True).clamp(max=vocab - 1)
    return sorted_ids.gather(1, index).squeeze(1)
