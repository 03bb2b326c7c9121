"""Scoring: a prompt's own logprobs, as evaluation harnesses ask for them. Legacy completions' ``echo`` puts the
prompt's tokens, text and (with ``logprobs``) logprobs ahead of the completion's, the first token's ``null``;
``max_tokens`` 0 with ``echo`` returns the prompt alone (the engine still samples one token, as vLLM's does). vLLM's
``prompt_logprobs`` (chat and completions) reports them in its own shape: per prompt token ``null`` for the first,
then token id -> ``{logprob, rank, decoded_token}`` for the prompt's token and the top ones asked for (said by
``logprobs.py``)."""

from __future__ import annotations

import dataclasses

from batchgen.schemas import ChatCompletionRequest, CompletionRequest

from ..engine.request import CompletionOutput, EngineResult
from ..engine.request import TokenLogprob as EngineTokenLogprob

Logprobs = list[EngineTokenLogprob | None]


def prompt_logprobs_count(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The top logprobs the engine computes at each prompt position (``None``: no prompt logprobs): enough for both
    ``prompt_logprobs`` and an echo's ``logprobs``."""
    echo = body.logprobs if isinstance(body, CompletionRequest) and body.echo else None
    counts = [count for count in (body.prompt_logprobs, echo) if count is not None]
    return max(counts) if counts else None


def prompt_logprob_entries(body: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]]) -> int:
    """How many logprobs the answer gives for its prompts: each prompt token's own and its top ones, in every choice,
    once for ``prompt_logprobs`` and once more for an echo's ``logprobs``."""
    per_token = 0 if body.prompt_logprobs is None else body.prompt_logprobs + 1
    if isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None:
        per_token += body.logprobs + 1
    return per_token * body.n * sum(map(len, prompts))


def wants_ranks(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """Ranks are reported in ``prompt_logprobs`` only (an echo's logprobs have none): they cost a pass over the
    logits of every prompt position."""
    return body.prompt_logprobs is not None


def engine_max_tokens(max_tokens: int | None) -> int | None:
    """``max_tokens`` 0 (only with ``echo``: the validator checks) runs one token, which the response leaves out."""
    return 1 if max_tokens == 0 else max_tokens


def echoed(
    body: CompletionRequest, prompt: list[int], result: EngineResult, output: CompletionOutput, prompt_text: str
) -> tuple[str, list[int], Logprobs | None]:
    """A choice with ``echo``: its text, its tokens and their logprobs, the prompt's ahead of the completion's (with
    ``max_tokens`` 0 the prompt's alone)."""
    generated = body.max_tokens != 0
    text = prompt_text + output.text if generated else prompt_text
    token_ids = [*prompt, *output.token_ids] if generated else list(prompt)
    if body.logprobs is None:
        return text, token_ids, None
    assert result.prompt_logprobs is not None  # asked for with echo and logprobs (prompt_logprobs_count)
    top = body.logprobs
    logprobs: Logprobs = [
        None if lp is None else dataclasses.replace(lp, top=lp.top[:top]) for lp in result.prompt_logprobs
    ]
    if generated:
        logprobs += output.logprobs or []
    return text, token_ids, logprobs
