"""The load-time self-check: a few tokens through the engine and through the model's own forward must agree.

The engine runs two requests together (one prompt prefilled in chunks beside the other: packing and chunked
continuation), decodes a few tokens, then runs the first prompt again (a prefix-cache hit). The model's own forward,
with transformers' eager attention, then scores the same tokens. If any logprob differs beyond the dtype's
tolerance, the engine cannot drive this model and refuses it, whatever the architecture: this catches what no list
of known architectures can (a layer that mixes tokens outside attention, a cache it keeps itself, a head that
post-processes logits in a way the engine does not reproduce).
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from .attention import ATTENTION_NAME
from .errors import ModelNotSupported
from .loader import input_embeddings
from .quantization import method_of
from .request import EngineRequest, EngineResult, SamplingParams

if TYPE_CHECKING:
    from .adapters import LoRARequest
    from .engine import LLMEngine
    from .model_runner import ModelRunner

NEW_TOKENS = 4
TOP = 5


def tolerance(dtype: torch.dtype, quantized: bool = False) -> float:
    """Largest logprob difference two correct attention implementations show in this dtype (the KV cache's). A
    quantized model rounds its weights, and some (bitsandbytes' 16-bit compute, int8 activations) their inputs, so a
    last-bit difference upstream moves a logprob as far as in a 16-bit model (measured: up to 0.025 on float32)."""
    if quantized:
        dtype = torch.bfloat16
    return {torch.float64: 1e-6, torch.float32: 1e-3}.get(dtype, 0.3)


def check_engine(engine: LLMEngine) -> None:
    """The check of an engine just built (``factory.build_engine``): of the base model, then, where ``--lora-modules``
    serves adapters, of the first (the slots and the prefix cache's salt, against the adapter applied directly)."""
    self_check(engine)
    if engine.served_adapters:
        self_check(engine, engine.served_adapters[0])


def self_check(engine: LLMEngine, lora: LoRARequest | None = None) -> None:
    """The check; with ``lora``, of that adapter's requests against the model's forward with the adapter applied
    directly (``LoRASlots.referencing``), prefix-cache hit included."""
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
    tol = tolerance(engine.runner.cache.k[0].dtype, method_of(model.config) is not None)
    for result, prompt, adapter in zip(results, (first, second, first), (lora, None, lora), strict=True):
        _compare(engine, result, prompt, tol, adapter)


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
        reference = _reference_logprobs(engine, prompt + output.token_ids)[len(prompt) - 1 :]
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


def _reference_logprobs(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    runner = engine.runner
    ids = torch.tensor([tokens], device=runner.device)
    if runner.group is None:
        return torch.log_softmax(reference_logits(runner, ids), dim=-1)
    try:  # a split model: every rank runs its forward
        runner.group.send_reference(ids)
        return torch.log_softmax(reference_logits(runner, ids), dim=-1)
    except Exception as exc:
        raise runner.group.failed(exc) from exc


@torch.no_grad()
def reference_logits(runner: ModelRunner, ids: torch.Tensor) -> torch.Tensor:
    """The model's own forward over ``ids`` (``[1, tokens]``), with transformers' eager attention: float32 logits."""
    model = runner.model
    model.set_attn_implementation("eager")
    try:
        fast = runner.fast
        with fast.off() if fast is not None else nullcontext():  # the compiled layers, packed linears are not it
            logits: torch.Tensor = model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    return logits
