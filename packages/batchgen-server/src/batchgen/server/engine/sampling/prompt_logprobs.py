"""A prompt's own logprobs (``SamplingParams.prompt_logprobs``): what scoring asks for (``echo`` with ``logprobs``,
vLLM's ``prompt_logprobs``). The logits row of prompt position ``p`` scores the prompt token at ``p + 1``, so a
prefill chunk of such a request keeps its rows' logits (``logits_to_keep``) besides the sampled one; a long prompt's
logprobs arrive over its chunks. They come from the model's raw logits in float32: no bias, penalty or grammar applies
to a prompt.

A request that asks for them reads nothing from the prefix cache (``Scheduler``): a cached token's K/V are there but
its logits never were. That is vLLM's choice too; computing the whole prompt is what scoring costs anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.transfer import HostCopy, indices
from ..request import TokenLogprob
from ..sequence import Sequence

ROWS_AT_ONCE = 512
"""Rows scored together: a long chunk's float32 log-softmax (and comparisons) is made a slice at a time, so a 2,048-row
chunk over a 150,000-token vocabulary does not hold gigabytes of temporaries at once."""


def prompt_rows(seq: Sequence, start: int, num_tokens: int) -> int:
    """How many of a chunk's rows (the tokens ``start`` to ``start + num_tokens`` of ``seq``) score a prompt token:
    those before the prompt's last position, for a sequence that still owes its request the prompt's logprobs."""
    if not seq.state.wants_prompt_logprobs(seq):
        return 0
    return max(0, min(start + num_tokens, seq.num_prompt_tokens - 1) - start)


@dataclass(slots=True)
class PromptSpan:
    """The rows of one chunk that score prompt tokens: they score the tokens ``first`` to ``first + count``."""

    seq: Sequence
    first: int
    count: int


class PromptLogprobs:
    """A step's prompt logprobs, launched on the device with one transfer back: per scored token, its logprob, its
    rank (where a span asks for ranks) and the top ``k`` logprobs (the largest ``prompt_logprobs`` any span
    asks for)."""

    def __init__(self, logits: torch.Tensor, rows: list[int], spans: list[PromptSpan]) -> None:
        """``rows``: the rows of ``logits`` (the step's kept rows) that score the spans' tokens, in order. Every kept
        row is scored (a sampled row against token 0, then dropped): the few sampled rows cost less than copying the
        many prompt rows out of the logits."""
        self.spans = spans
        targets = [0] * logits.shape[0]
        scored = (token for span in spans for token in span.seq.token_ids[span.first : span.first + span.count])
        for row, token in zip(rows, scored, strict=True):
            targets[row] = token
        self._k = k = min(max(span.seq.state.request.params.prompt_logprobs or 0 for span in spans), logits.shape[1])
        ranks = any(span.seq.state.request.params.prompt_ranks for span in spans)
        target = indices(targets, logits.device).unsqueeze(1)
        parts = []
        for start in range(0, logits.shape[0], ROWS_AT_ONCE):
            log_probs = torch.log_softmax(logits[start : start + ROWS_AT_ONCE].float(), dim=-1)
            chosen = log_probs.gather(1, target[start : start + ROWS_AT_ONCE])
            # Summing booleans in int32 is ~1.7x faster on CPU than torch's default int64.
            rank = (log_probs > chosen).sum(dim=1, keepdim=True, dtype=torch.int32) + 1 if ranks else chosen * 0
            if k == 1:  # echo's logprobs: 1 (what lm-eval sends); max is ~1.6x faster than topk on CPU
                top_lp, top_ids = (part.unsqueeze(1) for part in log_probs.max(dim=-1))
            else:
                top_lp, top_ids = log_probs.topk(k, dim=-1)
            # A row per scored token: its logprob, its rank, then k logprobs and k ids (ids are exact in float64).
            parts.append(torch.cat([chosen.double(), rank.double(), top_lp.double(), top_ids.double()], dim=1))
        self._host = HostCopy(torch.cat(parts)[indices(rows, logits.device)])

    def read(self) -> list[list[TokenLogprob]]:
        """Each span's logprobs, in order: the step waits for them with its sampled tokens."""
        rows, k = self._host.tolist(), self._k
        out, at = [], 0
        for span in self.spans:
            params = span.seq.state.request.params
            top = min(params.prompt_logprobs or 0, k)
            tokens = span.seq.token_ids[span.first : span.first + span.count]
            logprobs = []
            for token_id, row in zip(tokens, rows[at : at + span.count], strict=True):
                pairs = tuple(zip(map(int, row[2 + k : 2 + k + top]), row[2 : 2 + top], strict=True))
                logprobs.append(TokenLogprob(token_id, row[0], pairs, int(row[1]) if params.prompt_ranks else None))
            out.append(logprobs)
            at += span.count
        return out
