"""Pick the next token of every sampled row at once, on the model's device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import SamplingParams, TokenLogprob


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None
    generated_ids: list[int]
    """Tokens generated so far (for the presence/frequency penalties)."""


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """``logits`` is ``[rows, vocab]``; returns the chosen token ids and, where asked, their logprobs."""
        logits = logits.float()
        if any(r.params.presence_penalty or r.params.frequency_penalty for r in rows):
            logits = self._apply_penalties(logits, rows)
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
            k = max(rows[i].params.top_logprobs for i in wanted)
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
    def _sample(logits: torch.Tensor, rows: list[SampleRow], temperatures: list[float]) -> torch.Tensor:
        device = logits.device
        greedy = logits.argmax(dim=-1)
        temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=device).unsqueeze(1)
        scaled = logits / temps
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=device).unsqueeze(0)
        top_k = torch.tensor([r.params.top_k or logits.shape[1] for r in rows], device=device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        top_p = torch.tensor([r.params.top_p for r in rows], device=device).unsqueeze(1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = (probs.cumsum(dim=-1) - probs) >= top_p
        probs = probs.masked_fill(outside, 0.0)
        # Exponential-race sampling (argmax of p / E, E ~ Exp(1)) with each row's own generator: reproducible per
        # request whatever else is in the batch.
        noise = torch.empty_like(probs)
        for i, row in enumerate(rows):
            noise[i].exponential_(generator=row.generator)
        picked = sorted_ids.gather(1, (probs / noise).argmax(dim=-1, keepdim=True)).squeeze(1)
        is_greedy = torch.tensor([t == 0 for t in temperatures], device=device)
        return torch.where(is_greedy, greedy, picked)
