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
from .transfer import HostCopy, indices, to_device

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


@dataclass(slots=True)
class Sampled:
    """A step's sampled tokens (and logprobs) on their way to the host."""

    tokens: torch.Tensor
    """``[rows]`` on the device: what the next step's inputs take while the host has not read them."""
    _host: HostCopy
    """The tokens, then (where logprobs are asked for) the chosen logprobs, top logprobs and top ids, flat."""
    _rows: list[SampleRow]
    _wanted: list[int]
    _k: int

    def read(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """The chosen token ids and, where asked, their logprobs: the step's one wait for the device."""
        rows, wanted, k = self._rows, self._wanted, self._k
        host = self._host.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if not wanted:
            return host, logprobs  # the tokens alone: already ints
        token_ids = [int(t) for t in host[: len(rows)]]  # float64 in a copy shared with the logprobs
        chosen_list = host[len(rows) : len(rows) + len(wanted)]
        top_lp_list = host[len(rows) + len(wanted) : len(rows) + len(wanted) * (1 + k)]
        top_ids_list = host[len(rows) + len(wanted) * (1 + k) :]
        for j, i in enumerate(wanted):
            first, n = j * k, min(rows[i].params.top_logprobs, k)
            top = tuple(zip(map(int, top_ids_list[first : first + n]), top_lp_list[first : first + n], strict=True))
            logprobs[i] = TokenLogprob(token_ids[i], chosen_list[j], top)
        return token_ids, logprobs


class Sampler:
    """Stateless; every host value reaches the device through ``to_device`` (no synchronisation on CUDA), so the
    host prepares the sampling while the device still runs the forward, and the one transfer back is the step's
    only wait."""

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """``logits`` is ``[rows, vocab]``; returns the chosen token ids and, where asked, their logprobs."""
        return self.launch(logits, rows).read()

    def launch(self, logits: torch.Tensor, rows: list[SampleRow]) -> Sampled:
        """The same, left on the device: the host reads it later (``Sampled.read``)."""
        logits = self.process(logits.float(), rows)
        chosen = self.choose(logits, rows)
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs]
        if not wanted:
            return Sampled(chosen, HostCopy(chosen), rows, wanted, 0)
        k = min(max(rows[i].params.top_logprobs for i in wanted), logits.shape[1])
        index = indices(wanted, logits.device)
        log_probs = torch.log_softmax(logits[index], dim=-1)
        chosen_lp = log_probs.gather(1, chosen[index].unsqueeze(1))
        top_lp, top_ids = log_probs.topk(k, dim=-1)
        parts = (chosen, chosen_lp, top_lp, top_ids)
        flat = torch.cat([part.double().flatten() for part in parts])  # token ids are exact in float64
        return Sampled(chosen, HostCopy(flat), rows, wanted, k)

    @staticmethod
    def process(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The logits every later stage sees (and the logprobs report): logit bias, ``min_tokens``, then the
        penalties, in vLLM's order."""
        device = logits.device
        biased = [(i, token, bias) for i, r in enumerate(rows) for token, bias in r.params.logit_bias.items()]
        if biased:
            at, tokens, biases = zip(*biased, strict=True)
            values = to_device(torch.tensor(biases, dtype=logits.dtype), device)
            logits = logits.index_put((indices(at, device), indices(tokens, device)), values, accumulate=True)
        banned = [
            (i, token)
            for i, r in enumerate(rows)
            if len(r.token_ids) - r.num_prompt_tokens < r.params.min_tokens
            for token in r.stop_token_ids
        ]
        if banned:
            at, tokens = zip(*banned, strict=True)
            logits = logits.index_put((indices(at, device), indices(tokens, device)), _full(float("-inf"), device))
        penalised = [i for i, r in enumerate(rows) if has_penalties(r.params)]
        if penalised:
            index = indices(penalised, device)
            logits = logits.index_put((index,), _penalties(logits[index], [rows[i] for i in penalised]))
        return logits

    @staticmethod
    def choose(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The chosen token of every row: argmax for greedy rows, a draw from the filtered distribution otherwise."""
        sampled = [i for i, r in enumerate(rows) if r.params.temperature > 0]
        if not sampled:
            return argmax_first(logits)
        if len(sampled) == len(rows):
            return _sample(logits, rows)
        index = indices(sampled, logits.device)
        return argmax_first(logits).index_put((index,), _sample(logits[index], [rows[i] for i in sampled]))


def argmax_first(logits: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    """``logits.argmax(dim=-1)``, the first maximum of each row. torch's argmax over a wide row is scalar code on CPU
    (3.4 ms for 64 x 32,000); the maxima of 128-wide chunks are vectorised, so this finds the chunk first, then the
    token in it: 3-8x faster."""
    rows, vocab = logits.shape
    if vocab % chunk:
        return logits.argmax(dim=-1)
    chunks = logits.view(rows, -1, chunk)
    best = chunks.amax(dim=-1).argmax(dim=-1)
    return best * chunk + chunks[torch.arange(rows, device=logits.device), best].argmax(dim=-1)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=like.dtype), like.device).unsqueeze(1)


def _full(value: float, device: torch.device) -> torch.Tensor:
    """A scalar made on the device (no transfer)."""
    return torch.full((), value, device=device)


def has_penalties(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


def _flat(lists: Sequence[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index and token id of every element of ``lists``, as two flat tensors."""
    row_ids = [row for row, ids in enumerate(lists) for _ in range(len(ids))]
    return indices(row_ids, device), indices([token for ids in lists for token in ids], device)


def _penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """vLLM's repetition penalty over prompt and output tokens (divide a positive logit, multiply a negative one),
    then OpenAI's ``logit - count * frequency - (count > 0) * presence`` over the output tokens."""
    device = logits.device
    counts = torch.zeros_like(logits)
    generated = [r.token_ids[r.num_prompt_tokens :] for r in rows]
    counts.index_put_(_flat(generated, device), _full(1.0, device), accumulate=True)
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        seen = (counts > 0).index_put(
            _flat([r.token_ids[: r.num_prompt_tokens] for r in rows], device), _full(True, device)
        )
        repetition = _column([r.params.repetition_penalty for r in rows], logits)
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    frequency = _column([r.params.frequency_penalty for r in rows], logits)
    presence = _column([r.params.presence_penalty for r in rows], logits)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


def _sample(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, then ``min_p`` (drop tokens less likely than ``min_p`` times the likeliest), top-k and top-p
    on one sorted copy, then the inverse-CDF draw."""
    device, vocab = logits.device, logits.shape[1]
    logits = logits / _column([r.params.temperature for r in rows], logits)
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    # p < min_p * p_max  <=>  logit < max logit + log(min_p); log(0) = -inf keeps everything.
    dropped = sorted_logits < sorted_logits[:, :1] + torch.log(_column([r.params.min_p for r in rows], logits))
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    top_k = indices([min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in rows], device).unsqueeze(1)
    probs = sorted_logits.masked_fill(dropped | (ranks >= top_k), float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    probs = probs.masked_fill((probs.cumsum(dim=-1) - probs) >= _column([r.params.top_p for r in rows], probs), 0.0)
    cdf = probs.double().cumsum(dim=-1)
    seeds = indices([_signed(r.seed & _MASK64) for r in rows], device)
    draws = uniforms(seeds, indices([r.position for r in rows], device))
    index = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(1), right=True).clamp(max=vocab - 1)
    return sorted_ids.gather(1, index).squeeze(1)
