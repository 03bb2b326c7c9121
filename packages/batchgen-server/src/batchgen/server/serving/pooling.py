"""The pooling endpoints (``/v1/score``, ``/v1/rerank``, ``/classify``, ``/pooling``) and what ``/v1/embeddings``
takes from a model's sentence-transformers config: bodies into engine ``embed`` requests (pairs made as the model
scores them: a cross-encoder's ``[CLS] query [SEP] document [SEP]`` with token types, Qwen3-Reranker's template, a
decoder classifier's pair encoding), and the pooled vectors into vLLM's response shapes (scores through the model's
activation, a rerank sorted by relevance, labels and probabilities, Matryoshka truncation)."""

from __future__ import annotations

import base64
import functools
import math
import struct
import time
from typing import Any

from batchgen.schemas import (
    BODY_TYPES,
    MAX_POOLING_INPUTS,
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    PoolingBody,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    PoolingResponseBody,
    PoolingUsage,
    RequestBody,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    pairs_of,
)

from ..engine.features.adapters import LoRARequest
from ..engine.loading.pooling_spec import (
    QWEN3_RERANKER_INSTRUCTION,
    QWEN3_RERANKER_PREFIX,
    QWEN3_RERANKER_SUFFIX,
    PoolingSpec,
)
from ..engine.request import EngineRequest, EngineResult
from ..ids import engine_request_id
from .errors import RequestRejected
from .prompts import PromptTokenizer

ENDPOINT_NAMES: dict[type[RequestBody], str] = {
    ScoreRequest: "/v1/score",
    RerankRequest: "/v1/rerank",
    ClassificationRequest: "/classify",
    PoolingRequest: "/pooling",
    EmbeddingRequest: "/v1/embeddings",
}
"""Each pooling body's endpoint, by the name a model's spec lists it under (vLLM's other paths to it, ``/score``,
``/rerank`` and ``/v2/rerank``, decode to the same body: ``BODY_TYPES``)."""


KINDS = {
    "generate": "a generation model",
    "embed": "an embedding model",
    "classify": "a classifier",
    "reward": "a reward model",
    "yes_no": "a reranker",
}
"""How a refusal names what a model is."""


class PoolingServing:
    def __init__(self, tokenizer: Any, spec: PoolingSpec, prompts: PromptTokenizer) -> None:
        self.tokenizer = tokenizer
        self.spec = spec
        self.prompts = prompts
        self.max_context_length = prompts.max_context_length

    # ---- bodies in -------------------------------------------------------------------------------------------------

    def check_endpoint(self, path: str, model: str) -> None:
        """400 ``unsupported_endpoint`` where the model does not serve the pooling endpoint at ``path``."""
        spec, name = self.spec, ENDPOINT_NAMES[BODY_TYPES[path]]
        if name in spec.endpoints:
            return
        raise RequestRejected(
            "unsupported_endpoint",
            f"model {model!r} is {KINDS[spec.kind]}: it serves {', '.join(spec.endpoints)}, not {name} "
            "(docs/api.md, Pooling models, says which models serve what)",
        )

    def embedding_prompts(self, body: EmbeddingRequest, add_special_tokens: bool) -> list[list[int]]:
        """The inputs' token ids, each text after the instruction prefix ``prompt_name`` names (sentence-
        transformers' prompts; its default prompt where the request names none)."""
        self.check_dimensions(body.dimensions)
        name = body.prompt_name or self.spec.default_prompt_name
        prefix = ""
        if name is not None:
            if name not in self.spec.prompts:
                known = ", ".join(map(repr, self.spec.prompts)) or "none"
                raise RequestRejected(
                    "invalid_value", f"The model has no prompt {name!r} (it has {known}).", "prompt_name"
                )
            prefix = self.spec.prompts[name]
            if prefix and not self.spec.include_prompt and self.spec.mode == "mean":
                raise RequestRejected(
                    "invalid_value",
                    "The model's pooling leaves its prompt out (include_prompt: false), which batchgen does not run.",
                    "prompt_name",
                )
        body_input = body.input
        if prefix:
            if isinstance(body_input, str):
                body_input = prefix + body_input
            elif body_input and isinstance(body_input[0], str):
                body_input = [prefix + text for text in body_input]  # type: ignore[operator]
        return self.prompts.prompts(body_input, "input", add_special_tokens)

    def prepare(
        self, body: PoolingBody, request_id: str, online: bool, lora: LoRARequest | None
    ) -> list[EngineRequest]:
        """One engine request per pair or input, in order."""
        self.check_endpoint(ENDPOINT_NAMES[type(body)], body.model)
        limit = self._truncation(body)
        encoded: list[tuple[list[int], list[int] | None]]
        if isinstance(body, ScoreRequest | RerankRequest):
            queries, documents = pairs_of(body)
            param = "documents" if isinstance(body, RerankRequest) else body.sides()[1][0]
            self._check_count(len(documents), param)
            self._check_room(limit, self._pair_template())
            if body.instruction is not None and self.spec.kind == "yes_no" and limit is None:
                self._check_instruction(body.instruction)
            encoded = [
                self._pair(query, document, body.instruction, limit, f"{param}[{i}]" if len(documents) > 1 else param)
                for i, (query, document) in enumerate(zip(queries, documents, strict=True))
            ]
        else:
            if isinstance(body, PoolingRequest):
                self.check_dimensions(body.dimensions)
            encoded = [(ids, None) for ids in self._inputs(body, limit)]
        return [
            EngineRequest(
                engine_request_id(request_id, i), ids, task="embed", interactive=online, lora=lora, token_type_ids=types
            )
            for i, (ids, types) in enumerate(encoded)
        ]

    def _truncation(self, body: PoolingBody) -> int | None:
        limit = body.truncate_prompt_tokens
        if limit is None:
            return None
        if limit == -1:
            return self.max_context_length
        if limit == 0 or limit > self.max_context_length:
            raise RequestRejected(
                "invalid_value",
                f"truncate_prompt_tokens must be -1 or from 1 to the model's context of {self.max_context_length}.",
                "truncate_prompt_tokens",
            )
        return limit

    @functools.cached_property
    def _reranker_template(self) -> tuple[list[int], list[int]]:
        """Qwen3-Reranker's prefix and suffix, as token ids."""
        prefix = self.tokenizer.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
        return prefix, self.tokenizer.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)

    def _pair_template(self) -> int:
        """The tokens a pair's prompt has besides its texts."""
        if self.spec.kind == "yes_no":
            return sum(map(len, self._reranker_template))
        return int(self.tokenizer.num_special_tokens_to_add(pair=True))

    def _check_room(self, limit: int | None, template: int) -> None:
        """``truncate_prompt_tokens`` leaves the texts a token at least: the tokenizer would ignore a smaller one."""
        if limit is not None and limit <= template:
            raise RequestRejected(
                "invalid_value",
                f"truncate_prompt_tokens {limit} leaves no room for the text: the model's template takes {template} "
                "tokens of each prompt.",
                "truncate_prompt_tokens",
            )

    def _check_instruction(self, instruction: str) -> None:
        """A reranker's instruction that alone takes the context is the instruction's fault, not a document's."""
        if len(instruction) > self.prompts.max_prompt_chars:
            self._check_length(self.max_context_length + 1, "instruction")
        own = self.tokenizer.encode(f"<Instruct>: {instruction}\n", add_special_tokens=False)
        self._check_length(len(own) + self._pair_template(), "instruction")

    def _check_count(self, count: int, param: str) -> None:
        if count > MAX_POOLING_INPUTS:
            raise RequestRejected(
                "too_many_inputs",
                f"The request has {count} {param}; one request scores at most {MAX_POOLING_INPUTS}. Split it, or send "
                "the pairs as a batch (a line each, or a few hundred per line).",
                param,
            )

    def _inputs(self, body: ClassificationRequest | PoolingRequest, limit: int | None) -> list[list[int]]:
        """Each input's token ids, cut to ``limit`` tokens where set (the tokenizer's special tokens kept)."""
        prompt = body.input
        count = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
        self._check_count(count, "inputs")
        add = body.add_special_tokens if body.add_special_tokens is not None else True
        self._check_room(limit, int(self.tokenizer.num_special_tokens_to_add(pair=False)) if add else 0)
        prompts: list[list[int]]
        if limit is None:
            prompts = self.prompts.prompts(prompt, "input", add)
        else:
            items: list[Any] = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
            prompts = [
                list(self.tokenizer(item, add_special_tokens=add, truncation=True, max_length=limit)["input_ids"])
                if isinstance(item, str)
                else list(item)[:limit]
                for item in items
            ]
        for index, ids in enumerate(prompts):
            self._check_length(len(ids), "input" if len(prompts) == 1 else f"input[{index}]")
        return prompts

    def _pair(
        self, query: str, document: str, instruction: str | None, limit: int | None, param: str
    ) -> tuple[list[int], list[int] | None]:
        """A (query, document) pair's token ids (and token types, for a cross-encoder that has them)."""
        if len(query) + len(document) > self.prompts.max_prompt_chars and limit is None:
            self._check_length(self.max_context_length + 1, param)
        truncation: dict[str, Any] = {} if limit is None else {"truncation": "longest_first", "max_length": limit}
        if self.spec.kind == "yes_no":  # Qwen3-Reranker's recipe: its three parts tokenized on their own
            prefix, suffix = self._reranker_template
            text = f"<Instruct>: {instruction or QWEN3_RERANKER_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
            if limit is not None:  # _check_room: more than the template
                truncation["max_length"] = limit - len(prefix) - len(suffix)
            ids = prefix + self.tokenizer(text, add_special_tokens=False, **truncation)["input_ids"] + suffix
            self._check_length(len(ids), param)
            return ids, None
        encoded = self.tokenizer(query, document, **truncation)
        ids = list(encoded["input_ids"])
        self._check_length(len(ids), param)
        types = encoded.get("token_type_ids") if self.spec.encoder else None
        return ids, None if types is None else list(types)

    def _check_length(self, length: int, param: str) -> None:
        if length > self.max_context_length:
            raise RequestRejected(
                "context_length_exceeded",
                f"'{param}' makes {length} tokens; the model's context is {self.max_context_length}. Shorten it, or "
                "set truncate_prompt_tokens (-1: cut to the context).",
                param,
            )

    # ---- results out -----------------------------------------------------------------------------------------------

    def answer(self, body: PoolingBody, request_id: str, results: list[EngineResult]) -> PoolingResponseBody:
        """The 200 body of a pooling request whose results (one per pair or input, in order) all succeeded."""
        vectors = [result.embedding or [] for result in results]
        prompt_tokens = sum(result.prompt_tokens for result in results)
        usage = PoolingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
        now = int(time.time())
        activate = body.use_activation is not False
        if isinstance(body, RerankRequest):
            documents = pairs_of(body)[1]
            ranked = sorted(
                ((index, self.score(vector, activate)) for index, vector in enumerate(vectors)), key=lambda s: -s[1]
            )
            kept = ranked[: body.top_n] if body.top_n else ranked
            results_out = [
                RerankResult(
                    index=index,
                    document=RerankDocument(text=documents[index]) if body.return_documents else None,
                    relevance_score=score,
                )
                for index, score in kept
            ]
            rerank_usage = RerankUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
            return RerankResponse(id=f"rerank-{request_id}", model=body.model, usage=rerank_usage, results=results_out)
        if isinstance(body, ScoreRequest):
            data = [ScoreData(index=i, score=self.score(vector, activate)) for i, vector in enumerate(vectors)]
            return ScoreResponse(id=f"score-{request_id}", created=now, model=body.model, data=data, usage=usage)
        if isinstance(body, ClassificationRequest):
            classes = [self.classify(i, vector, activate) for i, vector in enumerate(vectors)]
            return ClassificationResponse(
                id=f"classify-{request_id}", created=now, model=body.model, data=classes, usage=usage
            )
        pooled = [
            PoolingData(index=i, data=encode(self.truncated(vector, body.dimensions), body.encoding_format))
            for i, vector in enumerate(vectors)
        ]
        return PoolingResponse(id=f"pool-{request_id}", created=now, model=body.model, data=pooled, usage=usage)

    def score(self, values: list[float], activate: bool) -> float:
        """A pair's relevance: the model's single output through its activation (sigmoid by default)."""
        value = values[0]
        return 1 / (1 + math.exp(-value)) if activate and self.spec.activation == "sigmoid" else value

    def classify(self, index: int, values: list[float], activate: bool) -> ClassificationData:
        probs = values
        if activate and len(values) > 1:
            top = max(values)
            exps = [math.exp(value - top) for value in values]
            probs = [value / sum(exps) for value in exps]
        elif activate:
            probs = [1 / (1 + math.exp(-values[0]))]
        best = max(range(len(values)), key=values.__getitem__)
        label = self.spec.labels[best] if best < len(self.spec.labels) else None
        return ClassificationData(index=index, label=label, probs=probs, num_classes=len(values))

    def check_dimensions(self, dimensions: int | None) -> None:
        """A request's ``dimensions``: one the model's Matryoshka config lists, where it lists them; at most the
        embedding's length."""
        allowed, size = self.spec.matryoshka_dimensions, self.spec.embedding_size
        if dimensions is not None and allowed is not None and dimensions not in allowed:
            raise RequestRejected("invalid_value", f"The model's dimensions are {list(allowed)}.", "dimensions")
        if dimensions is not None and size is not None and dimensions > size:
            raise RequestRejected(
                "invalid_value",
                f"dimensions {dimensions} is more than the model's embeddings have: {size}.",
                "dimensions",
            )

    def truncated(self, vector: list[float], dimensions: int | None) -> list[float]:
        """Matryoshka: the first ``dimensions`` values, normalized again where the model normalizes."""
        if dimensions is None or dimensions >= len(vector):
            return vector
        vector = vector[:dimensions]
        if self.spec.normalize:
            norm = math.sqrt(sum(x * x for x in vector)) or 1.0
            vector = [x / norm for x in vector]
        return vector


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """Floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
