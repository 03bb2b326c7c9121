"""Pick the next token of every sampled row at once, on the model's device.

Sampling is stateless: each row draws one uniform number from a hash of (its seed, the token's position) and takes
the token where it falls in the cumulative distribution (inverse-CDF sampling, exactly the categorical
distribution). So the same seed and input give the same tokens whatever else shares the batch, and a step that is
computed again (after a fault, say) samples exactly what it would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .request import SamplingParams, TokenLogprob

_MASK64 = 2**64 - 1


def mix64(*values: int) -> int:
    """splitmix64 over the values in turn: a well-spread 64-bit hash."""
    state = 0
    for value in values:
        state = (state + (value & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that depends only on ``seed`` and ``position``."""
    return (mix64(seed, position) >> 11) / 2**53


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    seed: int
    """The choice's own seed (the request's, mixed with the choice index)."""
    position: int
    """Position of the token being sampled in its sequence."""
    generated_ids: list[int]
    """Tokens generated so far (for the presence/frequency penalties)."""
    prompt_ids: Sequence[int] = ()
    """The prompt's tokens, for ``repetition_penalty`` (left empty when it is off)."""
    banned_ids: frozenset[int] = frozenset()
    """Tokens that may not be drawn at this position (the stop tokens, before ``min_tokens``)."""


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """``logits`` is ``[rows, vocab]``; returns the chosen token ids and, where asked, their logprobs."""
        logits = logits.float()
        if any(r.banned_ids or r.params.logit_bias for r in rows):
            logits = self._apply_biases(logits, rows)
        if any(r.params.presence_penalty or r.params.frequency_penalty for r in rows):
            logits = self._apply_penalties(logits, rows)
        if any(r.params.repetition_penalty != 1.0 for r in rows):
            logits = self._apply_repetition_penalty(logits, rows)
        temperatures = [r.params.temperature for r in rows]
        if all(t == 0 for t in temperatures):
            chosen = logits.argmax(dim=-1)
        else:
            chosen = self._sample(logits, rows, temperatures)
        token_ids: list[int] = chosen.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs]
        if wanted:
            index = torch.tensor(wanted, device=logits.device)
            log_probs = torch.log_softmax(logits[index], dim=-1)
            chosen_lp = log_probs.gather(1, chosen[index].unsqueeze(1)).squeeze(1).tolist()
            k = min(max(rows[i].params.top_logprobs for i in wanted), logits.shape[1])
            top_lp, top_ids = log_probs.topk(k, dim=-1) if k else (log_probs[:, :0], log_probs[:, :0].long())
            top_lp_list, top_ids_list = top_lp.tolist(), top_ids.tolist()
            for j, i in enumerate(wanted):
                n = rows[i].params.top_logprobs
                top = tuple(zip(top_ids_list[j][:n], top_lp_list[j][:n], strict=True))
                logprobs[i] = TokenLogprob(token_ids[i], chosen_lp[j], top)
        return token_ids, logprobs

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """OpenAI's definition: ``logit - count * frequency - (count > 0) * presence`` over generated tokens."""
        counts = torch.zeros_like(logits)
        for i, row in enumerate(rows):
            if row.generated_ids:
                ids = torch.tensor(row.generated_ids, device=logits.device)
                counts[i].index_add_(0, ids, torch.ones(len(ids), device=logits.device))
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=logits.device).unsqueeze(1)
        presence = torch.tensor([r.params.presence_penalty for r in rows], device=logits.device).unsqueeze(1)
        return logits - counts * frequency - (counts > 0).float() * presence

    @staticmethod
    def _apply_biases(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """``logit_bias`` added, then the banned tokens removed."""
        logits = logits.clone()
        for i, row in enumerate(rows):
            if row.params.logit_bias:
                ids = torch.tensor(list(row.params.logit_bias), dtype=torch.long, device=logits.device)
                biases = torch.tensor(list(row.params.logit_bias.values()), device=logits.device)
                logits[i].index_add_(0, ids, biases)
            if row.banned_ids:
                logits[i, torch.tensor(sorted(row.banned_ids), dtype=torch.long, device=logits.device)] = float("-inf")
        return logits

    @staticmethod
    def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """vLLM's definition: over the tokens of the prompt and the output, a positive logit is divided by the
        penalty and a negative one multiplied."""
        seen = torch.zeros_like(logits, dtype=torch.bool)
        for i, row in enumerate(rows):
            if row.params.repetition_penalty != 1.0:
                ids = torch.tensor([*row.prompt_ids, *row.generated_ids], dtype=torch.long, device=logits.device)
                seen[i, ids] = True
        penalty = torch.tensor([r.params.repetition_penalty for r in rows], device=logits.device).unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        return torch.where(seen, penalized, logits)

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SampleRow], temperatures: list[float]) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[1]
        greedy = logits.argmax(dim=-1)
        temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=device).unsqueeze(1)
        sorted_logits, sorted_ids = (logits / temps).sort(dim=-1, descending=True)
        min_p = torch.tensor([r.params.min_p for r in rows], device=device).unsqueeze(1)
        if bool((min_p > 0).any()):  # relative to the most likely token: probability ratios are logit differences
            floor = sorted_logits[:, :1] + torch.log(min_p)
            sorted_logits = sorted_logits.masked_fill(sorted_logits < floor, float("-inf"))
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        top_k = torch.tensor([min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in rows], device=device)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        top_p = torch.tensor([r.params.top_p for r in rows], device=device).unsqueeze(1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        probs = probs.masked_fill((probs.cumsum(dim=-1) - probs) >= top_p, 0.0)
        cdf = probs.double().cumsum(dim=-1)
        draws = torch.tensor([uniform(r.seed, r.position) for r in rows], dtype=torch.float64, device=device)
        index = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(1), right=True).clamp(max=vocab - 1)
        picked = sorted_ids.gather(1, index).squeeze(1)
        is_greedy = torch.tensor([t == 0 for t in temperatures], device=device)
        return torch.where(is_greedy, greedy, picked)
