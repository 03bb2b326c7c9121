"""Pick the next token of every sampled row at once, on the model's device, with one transfer to the host.

Every row's work is one batched tensor computation: the logit bias, ``min_tokens``, the penalties, greedy, temperature,
``min_p``, top-k and top-p apply to all rows together, whatever their mix of parameters. Only the rows that filter
(``min_p``, top-k, top-p) sort the vocabulary; the others draw from their distribution as it stands.

Sampling is stateless: each row draws one uniform number from a hash of (its seed, the token's position), computed
on the device (splitmix64 in 64-bit integer arithmetic), and takes the token where it falls in the cumulative
distribution (inverse-CDF sampling, exactly the categorical distribution). So the same seed and input give the same
tokens whatever else shares the batch, and a step that is computed again (after a fault, say) samples exactly what it
would have.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ops.transfer import HostCopy, to_device
from ..request import TokenLogprob
from .batch_state import SamplingInputs
from .grammar import token_bias
from .seeds import uniforms


@dataclass(slots=True)
class Sampled:
    """A step's sampled tokens (and logprobs) on their way to the host."""

    tokens: torch.Tensor
    """``[rows]`` on the device: what the next step's inputs take while the host has not read them."""
    _host: HostCopy
    """The tokens, then (where logprobs are asked for) the chosen logprobs, top logprobs and top ids, flat."""
    _rows: int
    _wanted: np.ndarray
    _top: np.ndarray
    """How many top logprobs each wanted row asked for."""
    _k: int

    def read(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """The chosen token ids and, where asked, their logprobs: the step's one wait for the device."""
        rows, wanted, k = self._rows, self._wanted, self._k
        host = self._host.tolist()
        logprobs: list[TokenLogprob | None] = [None] * rows
        if not len(wanted):
            return host, logprobs  # the tokens alone: already ints
        token_ids = [int(t) for t in host[:rows]]  # float64 in a copy shared with the logprobs
        chosen_list = host[rows : rows + len(wanted)]
        top_lp_list = host[rows + len(wanted) : rows + len(wanted) * (1 + k)]
        top_ids_list = host[rows + len(wanted) * (1 + k) :]
        for j, (i, top) in enumerate(zip(wanted.tolist(), self._top.tolist(), strict=True)):
            first, n = j * k, min(top, k)
            pairs = tuple(zip(map(int, top_ids_list[first : first + n]), top_lp_list[first : first + n], strict=True))
            logprobs[i] = TokenLogprob(token_ids[i], chosen_list[j], pairs)
        return token_ids, logprobs


class Sampler:
    """Stateless; it reads each row's parameters from the batch state (``SamplingInputs``), and every host value
    reaches the device through ``to_device`` (no synchronisation on CUDA), so the host prepares the sampling while
    the device still runs the forward, and the one transfer back is the step's only wait."""

    def __call__(self, logits: torch.Tensor, rows: SamplingInputs) -> tuple[list[int], list[TokenLogprob | None]]:
        """``logits`` is ``[rows, vocab]``; returns the chosen token ids and, where asked, their logprobs."""
        return self.launch(logits, rows).read()

    def launch(self, logits: torch.Tensor, rows: SamplingInputs) -> Sampled:
        """The same, left on the device: the host reads it later (``Sampled.read``)."""
        logits = self.process(logits.float(), rows)
        chosen = self.choose(logits, rows)
        wanted = rows.logprob_rows
        if not len(wanted):
            return Sampled(chosen, HostCopy(chosen), len(rows), wanted, wanted, 0)
        top = rows.top_logprobs[wanted]
        k = min(int(top.max()), logits.shape[1])
        index = _index(wanted, logits.device)
        log_probs = torch.log_softmax(logits[index], dim=-1)
        chosen_lp = log_probs.gather(1, chosen[index].unsqueeze(1))
        top_lp, top_ids = log_probs.topk(k, dim=-1)
        parts = (chosen, chosen_lp, top_lp, top_ids)
        flat = torch.cat([part.double().flatten() for part in parts])  # token ids are exact in float64
        return Sampled(chosen, HostCopy(flat), len(rows), wanted, top, k)

    @staticmethod
    def process(logits: torch.Tensor, rows: SamplingInputs) -> torch.Tensor:
        """The logits every later stage sees (and the logprobs report): logit bias, ``min_tokens``, then the
        penalties, in vLLM's order."""
        device = logits.device
        if rows.masks is not None:  # the grammar first: no bias can make a token it forbids possible
            at, masks = rows.masks
            bias = masks if masks.is_floating_point() else token_bias(to_device(masks, device), logits.shape[1])
            logits = logits + bias if len(at) == len(rows) else logits.index_add(0, _index(at, device), bias)
        if (biased := rows.bias()) is not None:
            at, tokens, values = biased
            bias = to_device(torch.from_numpy(values).to(logits.dtype), device)
            logits = logits.index_put((_index(at, device), _index(tokens, device)), bias, accumulate=True)
        if (banned := rows.banned()) is not None:
            at, tokens = banned
            logits = logits.index_put((_index(at, device), _index(tokens, device)), _full(float("-inf"), device))
        penalised = rows.penalised()
        if len(penalised):
            index = _index(penalised, device)
            logits = logits.index_put((index,), _penalties(logits[index], rows, penalised))
        return logits

    @staticmethod
    def choose(logits: torch.Tensor, rows: SamplingInputs) -> torch.Tensor:
        """The chosen token of every row: argmax for greedy rows, a draw from the filtered distribution otherwise."""
        sampled = rows.sampled
        if not len(sampled):
            return argmax_first(logits)
        if len(sampled) == len(rows):
            return _sample(logits, rows, sampled)
        index = _index(sampled, logits.device)
        return argmax_first(logits).index_put((index,), _sample(logits[index], rows, sampled))


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


def _index(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host index array as a ``long`` tensor on ``device``."""
    return to_device(torch.from_numpy(values.astype(np.int64, copy=False)), device)


def _columns(values: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """``[columns, rows]`` float32 host values as ``[columns, rows, 1]`` on ``like``'s device, in its dtype."""
    return to_device(torch.from_numpy(np.ascontiguousarray(values)), like.device).to(like.dtype).unsqueeze(-1)


def _full(value: float, device: torch.device) -> torch.Tensor:
    """A scalar made on the device (no transfer)."""
    return torch.full((), value, device=device)


def _penalties(logits: torch.Tensor, rows: SamplingInputs, at: np.ndarray) -> torch.Tensor:
    """vLLM's repetition penalty over prompt and output tokens (divide a positive logit, multiply a negative one),
    then OpenAI's ``logit - count * frequency - (count > 0) * presence`` over the output tokens."""
    counts, prompt_seen = rows.penalty_tables(at)
    floats = rows.floats(at)
    _, _, _, repetition, frequency, presence = _columns(floats, logits)
    if (floats[3] != 1.0).any():  # on the host: no wait for the device
        seen = (counts > 0) | prompt_seen
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    penalised: torch.Tensor = logits - counts * frequency - (counts > 0).to(logits.dtype) * presence
    return penalised


def _sample(logits: torch.Tensor, rows: SamplingInputs, at: np.ndarray) -> torch.Tensor:
    """Temperature, then the inverse-CDF draw, for the logits rows ``at``: over the distribution as it stands for rows
    that filter nothing, over one sorted copy filtered by ``min_p``, top-k and top-p for the others (``sorts``). A
    row's path depends on its own parameters alone, so its draw does not depend on what shares the batch."""
    device, vocab = logits.device, logits.shape[1]
    floats = rows.floats(at)
    temperature, top_p, min_p, *_ = _columns(floats, logits)
    logits = logits / temperature
    draws = uniforms(_index(rows.seeds[at], device), _index(rows.positions[at], device))
    top_k = np.minimum(rows.top_k(at), vocab)
    sorted_rows = sorts(floats, top_k, vocab)
    if not sorted_rows.any():
        return _inverse_cdf(logits.softmax(dim=-1), draws)
    if sorted_rows.all():
        return _filtered_draw(logits, draws, top_p, min_p, top_k)
    tokens = torch.empty(len(at), dtype=torch.long, device=device)
    plain, filtered = _index(np.flatnonzero(~sorted_rows), device), _index(np.flatnonzero(sorted_rows), device)
    tokens[plain] = _inverse_cdf(logits[plain].softmax(dim=-1), draws[plain])
    tokens[filtered] = _filtered_draw(
        logits[filtered], draws[filtered], top_p[filtered], min_p[filtered], top_k[sorted_rows]
    )
    return tokens


def sorts(floats: np.ndarray, top_k: np.ndarray, vocab: int) -> np.ndarray:
    """Which rows sort the vocabulary: those that filter it (``min_p`` above 0, top-k below the vocabulary, top-p
    below 1), given their ``[columns, rows]`` float parameters (``SamplingInputs.floats``) and top-k. Sorting a
    32,000-token row costs more than the rest of its draw."""
    _, top_p, min_p, *_ = floats
    filters: np.ndarray = (min_p > 0) | (top_k < vocab) | (top_p < 1)
    return filters


def _filtered_draw(
    logits: torch.Tensor, draws: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, top_k: np.ndarray
) -> torch.Tensor:
    """``min_p`` (drop tokens less likely than ``min_p`` times the likeliest), top-k and top-p on one sorted copy,
    then the draw."""
    device, vocab = logits.device, logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    # p < min_p * p_max  <=>  logit < max logit + log(min_p); log(0) = -inf keeps everything.
    dropped = sorted_logits < sorted_logits[:, :1] + torch.log(min_p)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    dropped |= ranks >= _index(top_k, device).unsqueeze(1)
    probs = sorted_logits.masked_fill(dropped, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    probs = probs.masked_fill((probs.cumsum(dim=-1) - probs) >= top_p, 0.0)
    return sorted_ids.gather(1, _inverse_cdf(probs, draws).unsqueeze(1)).squeeze(1)


def _inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """The index where each row's draw in [0, 1) falls in its cumulative distribution (``probs`` need not sum to 1;
    a token of probability 0 is never taken)."""
    cdf = probs.double().cumsum(dim=-1)
    index = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(1), right=True).clamp(max=probs.shape[1] - 1)
    return index.squeeze(1)
