"""The load-time self-check: a few tokens through the engine and through the model's own forward must agree.

The engine runs two requests together (one prompt prefilled in chunks beside the other: packing and chunked
continuation), decodes a few tokens, then runs the first prompt again (a prefix-cache hit). The model's own forward,
with transformers' eager attention, then scores the same tokens. If any logprob differs beyond the dtype's
tolerance, the engine cannot drive this model and refuses it, whatever the architecture: this catches what no list
of known architectures can (a layer that mixes tokens outside attention, a cache it keeps itself, a head that
post-processes logits in a way the engine does not reproduce).

Those prompts are a few blocks long. Where the model's attention reaches further back (a sliding window, a sparse
top-k selection, a compression stride: ``reach.py``), one more prompt runs past the longest of them, prefilled in a
few chunks and decoded past it, if the short part's time per token says it fits ``--self-check-budget-s``; else the
model is refused, naming the mechanism the check cannot reach.
"""

from __future__ import annotations

import random
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from .attention import ATTENTION_NAME
from .attention.reach import mechanisms
from .errors import ModelNotSupported, refused
from .features.multimodal.vision_step import attention_for
from .loading.loader import input_embeddings
from .loading.quantization import method_of
from .request import EngineRequest, EngineResult, SamplingParams

if TYPE_CHECKING:
    from .core.engine import LLMEngine
    from .features.adapters import LoRARequest
    from .runner.model_runner import ModelRunner

NEW_TOKENS = 4
TOP = 5
REACH_CHUNKS = 4
"""The prompt past the model's reach is prefilled in about this many chunks: continuations past a window's start."""


def tolerance(dtype: torch.dtype, quantized: bool = False) -> float:
    """Largest logprob difference two correct attention implementations show in this dtype (the KV cache's). A
    quantized model rounds its weights, and some (bitsandbytes' 16-bit compute, int8 activations) their inputs, so a
    last-bit difference upstream moves a logprob as far as in a 16-bit model (measured: up to 0.025 on float32)."""
    if quantized:
        dtype = torch.bfloat16
    return {torch.float64: 1e-6, torch.float32: 1e-3}.get(dtype, 0.3)


def check_engine(engine: LLMEngine) -> None:
    """The check of an engine just built (``factory.build_engine``): of the base model, then, where ``--lora-modules``
    serves adapters, of the first (the slots and the prefix cache's salt, against the adapter applied directly).
    Whatever it raises is the one-line refusal."""
    try:
        self_check(engine)
        if engine.served_adapters:
            self_check(engine, engine.served_adapters[0])
    except Exception as exc:
        raise refused(engine.runner.architecture, "its forward failed in the engine's self-check", exc) from None


def self_check(engine: LLMEngine, lora: LoRARequest | None = None) -> None:
    """The check; with ``lora``, of that adapter's requests against the model's forward with the adapter applied
    directly (``LoRASlots.referencing``), prefix-cache hit included."""
    started = time.monotonic()
    model = engine.runner.model
    bs = engine.config.block_size
    vocab = input_embeddings(model).shape[0]
    longest = min(2 * bs + 3, engine.max_context_length - NEW_TOKENS - 1)
    rng = random.Random(0)
    first = [rng.randrange(vocab) for _ in range(longest)]
    second = [rng.randrange(vocab) for _ in range(max(1, min(bs + 5, longest - 2)))]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=TOP)
    scheduler = engine.scheduler
    budget = scheduler.max_num_batched_tokens
    scheduler.max_num_batched_tokens = bs + 4  # the longer prompt takes several steps, beside the other's decode
    try:
        results = _run(
            engine,
            [EngineRequest("self-check-0", first, params, lora=lora), EngineRequest("self-check-1", second, params)],
        )
        results += _run(engine, [EngineRequest("self-check-2", first, params, lora=lora)])  # its prefix is cached now
    finally:
        scheduler.max_num_batched_tokens = budget
        engine.reset_stats()
    tol = tolerance(engine.runner.cache_dtype, method_of(model.config) is not None)
    for result, prompt, adapter in zip(results, (first, second, first), (lora, None, lora), strict=True):
        _compare(engine, result, prompt, tol, adapter)
    if lora is None:  # the adapters' own check is of their slots and salt, which the short prompts cover
        seconds_per_token = (time.monotonic() - started) / (2 * len(first) + len(second) + 3 * NEW_TOKENS)
        _reach(engine, len(first), second, seconds_per_token, tol)


def _reach(engine: LLMEngine, checked: int, beside: list[int], seconds_per_token: float, tol: float) -> None:
    """A prompt past the model's longest window or sparse selection (``reach.py``), prefilled in a few chunks
    beside another sequence's decodes, then decoded past it; or the refusal naming the mechanism if that would take
    longer than ``--self-check-budget-s`` (estimated from the short part's time per token)."""
    runner, config = engine.runner, engine.config
    found = mechanisms(runner.model.config.get_text_config(), runner.windows)
    if not found:
        return
    mechanism = found[-1]
    length = min(mechanism.tokens + config.block_size + 3, engine.max_context_length - NEW_TOKENS - 1)
    if length <= checked:  # the short prompts reached past it already, or no request can reach it
        return
    estimate = seconds_per_token * (length + NEW_TOKENS)
    if estimate > config.self_check_budget_s:
        raise ModelNotSupported(
            runner.architecture,
            f"the self-check cannot reach past {mechanism.what} in time: a prompt of {length} tokens would take "
            f"about {estimate:.0f} s, over --self-check-budget-s {config.self_check_budget_s:g}; raise it, or run "
            "with the self-check off at your own risk",
        )
    rng = random.Random(1)
    prompt = [rng.randrange(engine.vocab_size) for _ in range(length)]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=TOP)
    scheduler = engine.scheduler
    budget = scheduler.max_num_batched_tokens
    scheduler.max_num_batched_tokens = min(budget, max(config.block_size + 4, -(-length // REACH_CHUNKS)))
    try:
        result, _ = _run(
            engine,
            [EngineRequest("self-check-reach", prompt, params), EngineRequest("self-check-beside", beside, params)],
        )
    finally:
        scheduler.max_num_batched_tokens = budget
        engine.reset_stats()
    _compare(engine, result, prompt, tol, None)


def _run(engine: LLMEngine, requests: list[EngineRequest]) -> list[EngineResult]:
    for request in requests:
        engine.add_request(request)
    results: dict[str, EngineResult] = {}
    while engine.has_unfinished_requests():
        results.update((result.request_id, result) for result in engine.step())
    return [results[request.request_id] for request in requests]


def _compare(engine: LLMEngine, result: EngineResult, prompt: list[int], tol: float, lora: LoRARequest | None) -> None:
    architecture = engine.runner.architecture
    if result.error is not None:
        raise ModelNotSupported(architecture, f"a self-check request failed in the engine: {result.error.message}")
    where = "" if lora is None else f" with LoRA adapter {lora.name!r}"
    output = result.outputs[0]
    assert output.logprobs is not None
    slots = engine.lora
    with slots.referencing(slots.weights(lora) if lora else None) if slots is not None else nullcontext():
        reference = _reference_logprobs(engine, prompt + output.token_ids, lora)[len(prompt) - 1 :]
    worst = 0.0
    for position, (token, expected) in enumerate(zip(output.logprobs, reference, strict=False)):
        pairs = [(token.token_id, token.logprob), *token.top]
        worst = max(worst, *(abs(lp - expected[i].item()) for i, lp in pairs))
        if expected[token.token_id] < expected.max() - tol:
            raise ModelNotSupported(
                architecture,
                f"greedy decoding through the engine picked another token than the model's own forward "
                f"(self-check{where}, generated token {position})",
            )
    if worst > tol:
        raise ModelNotSupported(
            architecture,
            f"its logprobs through the engine{where} differ from the model's own forward by {worst:.3g} "
            f"(self-check tolerance {tol:g}); run with the self-check off only if you know why",
        )


def _reference_logprobs(engine: LLMEngine, tokens: list[int], lora: LoRARequest | None) -> torch.Tensor:
    runner = engine.runner
    ids = torch.tensor([tokens], device=runner.device)
    if runner.group is None:
        return torch.log_softmax(reference_logits(runner, ids), dim=-1)
    try:  # a split model: every rank runs its forward
        runner.group.send_reference(ids, lora)
        return torch.log_softmax(reference_logits(runner, ids), dim=-1)
    except Exception as exc:
        raise runner.group.failed(exc) from exc


@torch.no_grad()
def reference_logits(runner: ModelRunner, ids: torch.Tensor) -> torch.Tensor:
    """The model's own forward over ``ids`` (``[1, tokens]``), with transformers' eager attention: float32 logits."""
    model = runner.model
    model.set_attn_implementation(attention_for(model, "eager"))
    try:
        fast = runner.fast
        with fast.off() if fast is not None else nullcontext():  # the compiled layers, packed linears are not it
            logits: torch.Tensor = model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(attention_for(model, ATTENTION_NAME))
    return logits
