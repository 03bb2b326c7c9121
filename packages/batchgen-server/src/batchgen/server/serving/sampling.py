"""A generation request's sampling parameters: the request's values, else its batch's defaults, else the model's
generation config's, else batchgen's (greedy, no limit but the context)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchgen.schemas import ChatCompletionRequest, CompletionRequest, GenerationDefaults

from ..engine.request import SamplingParams
from .errors import RequestRejected
from .scoring import engine_max_tokens, prompt_logprobs_count, wants_ranks
from .structured import output_constraint


class BatchDefaults(GenerationDefaults, kw_only=True):
    """The schemas' batch-level defaults (a batchgen extension); values set on a request override them."""

    @classmethod
    def of(cls, source: object) -> BatchDefaults:
        """The defaults carried by anything with these attributes: a ``BatchObject``, parsed CLI arguments."""
        return cls(**{name: getattr(source, name) for name in GenerationDefaults.__struct_fields__})


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    defaults: BatchDefaults,
    model: Mapping[str, Any],
    added_tokens: Mapping[str, int],
) -> SamplingParams:
    """``model`` holds the generation config's values by request field (``--generation-config``); ``added_tokens``
    the one-token markers a grammar may name."""
    logprobs, top_logprobs = False, 0
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest):
        logprobs, top_logprobs = bool(body.logprobs), body.top_logprobs or 0
        if body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
    elif body.logprobs is not None:
        logprobs, top_logprobs = True, body.logprobs
    max_tokens = first_set(max_tokens, defaults.max_decoding_length, model.get("max_tokens"), None)
    if body.min_tokens and max_tokens is not None and body.min_tokens > max_tokens:
        raise RequestRejected(
            "invalid_value", f"min_tokens {body.min_tokens} is more than max_tokens {max_tokens}", "min_tokens"
        )
    constraint = output_constraint(body, defaults.response_format, added_tokens)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        max_tokens=engine_max_tokens(max_tokens),
        temperature=first_set(body.temperature, defaults.temperature, model.get("temperature"), 0.0),
        top_p=first_set(body.top_p, defaults.top_p, model.get("top_p"), 1.0),
        top_k=max(first_set(body.top_k, defaults.top_k, model.get("top_k"), 0), 0),
        min_p=first_set(body.min_p, model.get("min_p"), 0.0),
        seed=body.seed,
        n=body.n,
        stop=tuple(s for s in stop if s),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens or 0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=first_set(body.repetition_penalty, model.get("repetition_penalty"), 1.0),
        logit_bias={int(token): bias for token, bias in (body.logit_bias or {}).items()},
        skip_special_tokens=body.skip_special_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs_count(body),
        prompt_ranks=wants_ranks(body),
        max_context_length=defaults.max_context_length,
        grammar=None if constraint is None else constraint.grammar,
    )


def first_set(*values: Any) -> Any:
    """The first value that is set; the last one if none is."""
    return next((v for v in values if v is not None), values[-1])
