"""What goes into the engine and what comes out: token-level, free of any HTTP or OpenAI shape."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection, Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .features.adapters import LoRARequest
    from .features.multimodal.prompt import MultimodalPrompt

logger = logging.getLogger("batchgen.server.engine")

FinishReason = Literal["stop", "length"]
Task = Literal["generate", "embed"]
"""``embed``: the prompt pooled into one vector by the model's pooler (an embedding, a classifier's logits, a
reranker's score: ``pooling.py``)."""


GREEDY_BELOW = 1e-5
"""vLLM's threshold: dividing the logits by a smaller temperature overflows float32 (a row of ``inf`` gives a NaN
distribution, which draws any token, one a grammar forbids included); so small a temperature is greedy anyway."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = None
    """Most tokens to generate per choice; ``None`` runs until a stop condition or the context is full."""
    temperature: float = 0.0
    """Below ``GREEDY_BELOW`` (``0`` included) greedy decoding."""
    top_p: float = 1.0
    top_k: int = 0
    """``0`` or ``-1`` disable top-k."""
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    """OpenAI's: ``logit - (count > 0) * presence_penalty`` over the tokens generated so far."""
    frequency_penalty: float = 0.0
    """OpenAI's: ``logit - count * frequency_penalty`` over the tokens generated so far."""
    repetition_penalty: float = 1.0
    """vLLM's: the logit of a token already in the prompt or the output is divided by it (multiplied when negative);
    ``1`` is off."""
    min_p: float = 0.0
    """Tokens less likely than ``min_p`` times the most likely one are dropped; ``0`` is off."""
    min_tokens: int = 0
    """No stop token (EOS, ``stop_token_ids``) and no stop string ends a choice before it has this many tokens."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> a bias added to its logit before sampling (-100 bans it, +100 forces it)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text (the token ids keep them)."""
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    """The prompt's own logprobs (from the model's raw logits), each with this many top logprobs; ``None``: none.
    Such a request reads nothing from the prefix cache (a cached token has no logits)."""
    prompt_ranks: bool = True
    """Each prompt token's rank in the vocabulary too (vLLM's ``prompt_logprobs`` report it; ``echo`` does not): a
    pass over every scored row's logits, the costliest part of scoring on CPU."""
    max_context_length: int | None = None
    """Cap on prompt + generated tokens (the batch's ``max_context_length``); the model's own limit always applies."""
    grammar: str | None = None
    """An llguidance grammar (its canonical text) every generated token must follow; ``None``: unconstrained."""
    grammar_after: tuple[int, ...] = ()
    """Token ids that end a reasoning model's thinking: the grammar constrains what follows them (``()``: from the
    first token)."""

    @property
    def penalised(self) -> bool:
        """Whether a penalty reads the tokens so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class GrammarError(ValueError):
    """A grammar that cannot be compiled (invalid, unsupported, or too slow to compile), or that the grammar library
    cannot follow as the output goes (a schema too large for its parser): the request's fault."""


MAX_REASON_CHARS = 500
"""llguidance's errors may quote the grammar: a refusal keeps (and says) this much of it."""


def grammar_key(grammar: str) -> bytes:
    """What a grammar (``SamplingParams.grammar``) is cached by, compiled or refused: its text's hash, so that the
    text of a 3 MB schema is not kept."""
    return hashlib.sha256(grammar.encode("utf-8", "surrogatepass")).digest()


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    task: Task = "generate"
    interactive: bool = False
    """An online request, someone waiting on it: admitted ahead of batch work, preempting a batch sequence when the
    running set is full."""
    stream: bool = False
    """Report each step's new tokens as they come (results with ``finished`` false) before the final result."""
    lora: LoRARequest | None = None
    """The LoRA adapter it runs with (``None``: the base model)."""
    multimodal: MultimodalPrompt | None = None
    """Its prompt's images (``multimodal/prompt.py``): their placeholders are among ``prompt_token_ids``."""
    token_type_ids: list[int] | None = None
    """A BERT-style cross-encoder's pair: each prompt token's segment (0: the query, 1: the document)."""

    def block_keys(self, start: int, end: int) -> tuple[bytes, ...]:
        """What the KV block of prompt positions ``start`` to ``end`` is keyed by besides its tokens: the images whose
        placeholders it holds (the same tokens, another picture)."""
        return () if self.multimodal is None else self.multimodal.block_keys(start, end)

    def chunk_tokens(self, computed: int, num_tokens: int) -> int:
        """The tokens a prefill chunk from ``computed`` may take of ``num_tokens``: it does not end inside a run of
        image tokens that attend both ways."""
        mm = self.multimodal
        return num_tokens if mm is None or not mm.spans else mm.chunk_tokens(computed, num_tokens)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """The ``top_logprobs`` most likely tokens at this position, most likely first."""
    rank: int | None = None
    """The token's rank among the vocabulary (1: the most likely); set on prompt logprobs only."""


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    """``None`` in a partial result while the choice is still running."""
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class EngineError:
    code: str
    """OpenAI-style code, e.g. ``context_length_exceeded``."""
    message: str


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """When a request reached each point in the engine (wall clock, ``time.time()``: comparable across processes)."""

    arrival: float
    """Added to the engine."""
    scheduled: float
    """First part of a step (its queue time ends)."""
    first_token: float | None
    """Its first token was sampled (``None`` for an embedding)."""
    finished: float


@dataclass(slots=True)
class EngineResult:
    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0
    outputs: list[CompletionOutput] = field(default_factory=list)
    embedding: list[float] | None = None
    error: EngineError | None = None
    times: RequestTimes | None = None
    """Set on the results of requests that ran (not on those refused at admission)."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: one per prompt token, ``None`` for the first (nothing precedes it)."""
    finished: bool = True
    """``False`` for a streamed request's partial result: each of its outputs holds only what is new since the last
    one (tokens, text, logprobs), for the choices that moved. The final result holds everything, as unstreamed."""

    @property
    def completion_tokens(self) -> int:
        return sum(len(output.token_ids) for output in self.outputs)


def failed_result(request: EngineRequest, exc: BaseException) -> EngineResult:
    """The result of a request whose step raised (the engine goes on with the others); logged with the traceback,
    unless its grammar could not be followed (the request's fault, not the server's)."""
    if isinstance(exc, GrammarError):
        error = EngineError("invalid_grammar", f"The output's grammar could not be followed: {exc}")
        return EngineResult(request.request_id, len(request.prompt_token_ids), error=error)
    logger.error("request %s failed inside the engine", request.request_id, exc_info=exc)
    message = f"The engine failed while running this request ({type(exc).__name__}: {exc})."
    error = EngineError("server_error", message)
    return EngineResult(request.request_id, len(request.prompt_token_ids), error=error)


def vocabulary_problem(name: str, token_ids: Collection[int], vocab_size: int) -> str | None:
    """Why the token ids of a request's ``name`` (its prompt, ``stop_token_ids``, ``logit_bias``) break the rule
    every token id a request names keeps, or ``None``: the model has it, ``0 <= id < vocab_size`` (a row of its
    embedding). The serving layer and the engine's admission both ask it."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return None
    outside = [token for token in token_ids if not 0 <= token < vocab_size][:5]
    return f"'{name}' has token ids outside the model's vocabulary (0-{vocab_size - 1}): {outside}."


def admission_error(
    request: EngineRequest, max_len: int, known_ids: Container[str], vocab_size: int
) -> EngineError | None:
    """Why ``request`` cannot run at all (empty prompt, over the context, a token id the model does not have, id
    already known), or ``None``.

    The serving layer refuses token ids the model does not have first, naming the request's field; they are checked
    again here because an engine request may come from any caller (benchmarks and tests build them directly), and on
    a GPU an id past the embedding is a device-side assert, which ends every request on the device, not an error of
    this one."""
    prompt, params = request.prompt_token_ids, request.params
    prompt_len = len(prompt)
    if prompt_len == 0:
        return EngineError("invalid_prompt", "The prompt is empty.")
    named = (("prompt", prompt), ("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias))
    for name, token_ids in named:
        if (problem := vocabulary_problem(name, token_ids, vocab_size)) is not None:
            return EngineError("invalid_prompt" if name == "prompt" else "invalid_value", problem)
    if prompt_len > max_len or (request.task == "generate" and prompt_len == max_len):
        return EngineError(
            "context_length_exceeded",
            f"The prompt has {prompt_len} tokens; the maximum context length is {max_len} tokens"
            + (" (prompt + at least one generated token)." if request.task == "generate" else "."),
        )
    if request.request_id in known_ids:
        return EngineError("duplicate_request_id", f"Request id {request.request_id!r} is already running.")
    return None
