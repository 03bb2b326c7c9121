"""EncoderEngine: the engine facade for encoder-only models (BERT, RoBERTa, MiniLM, E5, BGE, ...): embeddings, and
cross-encoders' scores (``*ForSequenceClassification``: ms-marco, bge-reranker)."""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from typing import Any

import torch
from transformers import PreTrainedModel

from ..config import EngineConfig
from ..interface import EngineStats
from ..loading.loader import input_embeddings
from ..loading.pooling_spec import PoolingSpec
from ..request import EngineError, EngineRequest, EngineResult, Task, admission_error, failed_result


class EncoderEngine:
    """A ``SteppingEngine`` like ``LLMEngine``, so ``EngineWorker``, the server and run-batch use it unchanged.

    An encoder has no KV cache and no causal mask: each step runs whole prompts of similar lengths as one padded
    batch through the model's own forward with an attention mask (and the pair's token types, where a request has
    them), at most ``max_num_seqs`` rows and ``max_num_batched_tokens`` padded tokens (a longer prompt runs alone).
    An embedding is the last hidden state pooled as the model's ``spec`` says (the mean over the prompt's tokens by
    default), L2-normalized where it says so; a classifier's result is its head's logits, as its own forward makes
    them (its own pooling included). A batch whose forward raises runs again in halves, down to
    one request, so only the request(s) that make it fail are failed and the others get their embeddings.
    """

    tasks: frozenset[Task] = frozenset({"embed"})

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        config: EngineConfig,
        model_name: str,
        spec: PoolingSpec | None = None,
    ) -> None:
        config.apply_torch_threads()
        self.spec = spec or PoolingSpec("embed", type(model).__name__, encoder=True)
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model = model
        self.device: torch.device = input_embeddings(model).device
        self.vocab_size: int = model.config.vocab_size
        """Token ids a request may name: rows of the embedding."""
        model_limit = encoder_context_length(model)
        self.max_context_length: int = min(config.max_model_len or model_limit, model_limit)
        self.pad_token_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._waiting: dict[str, EngineRequest] = {}  # insertion order is arrival order
        self._ready: list[EngineResult] = []
        self._step: list[EngineRequest] = []
        """The batch being embedded: the suspects if the step fails beyond the isolation."""
        self._prompt_tokens = 0

    def prepare(self, request: EngineRequest) -> list[Future[Any]]:
        """Nothing: an embedding has no grammar to compile."""
        return []

    def add_request(self, request: EngineRequest) -> None:
        error = admission_error(request, self.max_context_length, self._waiting, self.vocab_size)
        if error is None and request.task != "embed":
            error = EngineError("unsupported_endpoint", f"Model {self.model_name!r} is an embedding model.")
        if error is None and request.lora is not None:  # its padded forward has no adapter slots
            error = EngineError("invalid_adapter", f"Encoder model {self.model_name!r} serves no LoRA adapters.")
        if error is not None:
            self._ready.append(EngineResult(request.request_id, len(request.prompt_token_ids), error=error))
            return
        self._waiting[request.request_id] = request

    def abort_request(self, request_id: str) -> bool:
        """Drop a queued request (no result is produced for it); ``False`` if it is unknown or already done."""
        return self._waiting.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._ready)

    def stats(self) -> EngineStats:
        return EngineStats(
            queued=len(self._waiting),
            running=0,
            kv_blocks_total=0,
            kv_blocks_free=0,
            prompt_tokens=self._prompt_tokens,
            cached_tokens=0,
            generated_tokens=0,
            preemptions=0,
        )

    def suspects(self) -> list[str]:
        return [request.request_id for request in self._step]

    def reset(self) -> None:
        self._waiting.clear()
        self._ready.clear()
        self._step = []

    def close(self) -> None:
        """Nothing outlives it (one process, no group)."""

    def step(self) -> list[EngineResult]:
        """Embed the next batch of queued requests; return the requests that finished."""
        finished, self._ready = self._ready, []
        self._step = self._next_batch()
        self._run(self._step, finished)
        self._step = []
        return finished

    def _run(self, batch: list[EngineRequest], finished: list[EngineResult]) -> None:
        if not batch:
            return
        try:
            embeddings = self._embed(batch)
        except Exception as exc:
            if len(batch) == 1:
                finished.append(failed_result(batch[0], exc))
                return
            self._run(batch[: len(batch) // 2], finished)
            self._run(batch[len(batch) // 2 :], finished)
            return
        for request, embedding in zip(batch, embeddings, strict=True):
            result = EngineResult(request.request_id, len(request.prompt_token_ids), embedding=embedding)
            finished.append(result)
            self._prompt_tokens += len(request.prompt_token_ids)

    def _next_batch(self) -> list[EngineRequest]:
        """The oldest waiting request, joined by those of the next ``max_num_seqs`` closest to it in length.

        Similar lengths waste little on padding; always taking the oldest keeps the queue first come, first served.
        """
        window = list(itertools.islice(self._waiting.values(), self.config.max_num_seqs))
        if not window:
            return []
        head_len = len(window[0].prompt_token_ids)
        batch, longest = [window[0]], head_len
        for request in sorted(window[1:], key=lambda r: abs(len(r.prompt_token_ids) - head_len)):
            longest_with = max(longest, len(request.prompt_token_ids))
            if (len(batch) + 1) * longest_with <= self.config.max_num_batched_tokens:
                batch.append(request)
                longest = longest_with
        for request in batch:
            del self._waiting[request.request_id]
        return batch

    @torch.inference_mode()
    def _embed(self, batch: list[EngineRequest]) -> list[list[float]]:
        prompts = [request.prompt_token_ids for request in batch]
        longest = max(map(len, prompts))
        input_ids = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, : len(prompt)] = torch.tensor(prompt)
            mask[row, : len(prompt)] = 1
        inputs = {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device)}
        # A cross-encoder's pairs: query 0, document 1 (a model of one token type, XLM-R's, takes none).
        if getattr(self.model.config, "type_vocab_size", 2) > 1 and any(request.token_type_ids for request in batch):
            types = torch.zeros((len(prompts), longest), dtype=torch.long)
            for row, request in enumerate(batch):
                if request.token_type_ids:
                    types[row, : len(request.token_type_ids)] = torch.tensor(request.token_type_ids)
            inputs["token_type_ids"] = types.to(self.device)
        output = self.model(**inputs)
        if self.spec.kind in ("classify", "reward"):
            logits: list[list[float]] = output.logits.float().tolist()
            return logits
        return pool_padded(output.last_hidden_state, inputs["attention_mask"], self.spec).tolist()


def encoder_context_length(model: PreTrainedModel) -> int:
    """Most tokens per input: ``max_position_embeddings``, less RoBERTa's offset (its positions start after the
    padding index)."""
    limit: int = model.config.max_position_embeddings
    padding_idx = getattr(getattr(model, "embeddings", None), "padding_idx", None)
    return limit - (padding_idx + 1) if padding_idx is not None else limit


def pool_padded(hidden: torch.Tensor, mask: torch.Tensor, spec: PoolingSpec) -> torch.Tensor:
    """A padded batch's last hidden states ``[rows, tokens, hidden]`` (right-padded) pooled as ``spec`` says."""
    lengths = mask.sum(dim=1)
    if spec.mode == "mean":
        pooled = (hidden.float() * mask.unsqueeze(-1)).sum(dim=1) / lengths.unsqueeze(-1)
    elif spec.mode == "cls":
        pooled = hidden[:, 0].float()
    else:
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1].float()
    return torch.nn.functional.normalize(pooled, dim=-1) if spec.normalize else pooled
