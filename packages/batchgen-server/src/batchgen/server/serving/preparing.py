"""A request body made ready to run: checked against what this server serves and allows, its prompts tokenized and
its sampling parameters set, as engine requests. A response request runs as its chat request, translated here once
and kept, with a chat's message plan, until the request is answered (``PreparedRequest``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from batchgen.schemas import (
    BODY_TYPES,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    PoolingBody,
    RequestBody,
    ResponseRequest,
    sequences_of,
    unsupported_parameter,
)
from batchgen.schemas.responses_api import translate

from ..engine.features.adapters import MAX_NAME_CHARS, LoRARequest, ServedNames
from ..engine.loading.pooling_spec import PoolingSpec
from ..engine.request import EngineRequest, SamplingParams, Task, vocabulary_problem
from ..ids import engine_request_id
from ..media.fetcher import Fetched
from .chat_template import check_chat_template, render_chat
from .config import ServingConfig
from .errors import RequestRejected
from .images import ImagePrompter, image_parts, media_of, part_urls, response_images
from .messages import MessagePlan, MessagePlanner
from .pooling import ENDPOINT_NAMES, KINDS, PoolingServing
from .prompts import PromptTokenizer
from .sampling import BatchDefaults, first_set, sampling_params
from .scoring import prompt_logprob_entries

NAMES_LISTED = 8
"""Served names a ``model_not_found`` says (every tenant gets it: not a list of hundreds of adapters)."""

RunnableBody = ChatCompletionRequest | CompletionRequest | EmbeddingRequest | PoolingBody
"""What engine requests are made from: a response request runs as its chat request."""


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request body made ready to run: its engine requests, and what its answer is made from, kept with it until
    it is answered."""

    body: RequestBody
    """As received: a response request is answered with a ``response``."""
    runs_as: RunnableBody
    """``body``, or the chat request a response request runs as (translated once, when prepared)."""
    request_id: str
    requests: list[EngineRequest]
    """One per prompt, in prompt order: the order its results are taken in."""
    plan: MessagePlan | None = None
    """A chat's: how its choices are read."""


class RequestPreparer:
    def __init__(
        self,
        tokenizer: Any,
        served_names: ServedNames,
        *,
        max_context_length: int,
        vocab_size: int,
        tasks: frozenset[Task],
        max_sequences: int,
        generation_defaults: Mapping[str, Any],
        config: ServingConfig,
        spec: PoolingSpec,
        images: ImagePrompter | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.images = images or media_of(config)
        """A chat's image parts: through the model's processor, or refused by a text-only model."""
        self.served_names = served_names
        self.vocab_size = vocab_size
        """The model's: the token ids a request may name are ``0`` to ``vocab_size - 1`` (``vocabulary_problem``)."""
        self.tasks = tasks
        """What the engine runs (``engine.tasks``): an encoder model only embeds."""
        self.max_sequences = max_sequences
        """Most sequences (prompts x n) one request may ask for; a request over it is rejected before tokenizing."""
        self.generation_defaults = generation_defaults
        """The model's sampling defaults by request field (``--generation-config``), beneath a batch's own."""
        self.max_prompt_logprob_entries = config.max_prompt_logprob_entries
        self.prompts = PromptTokenizer(tokenizer, max_context_length)
        self.pooling = PoolingServing(tokenizer, spec, self.prompts)
        """The pooling endpoints, and what embeddings take from the model's pooling config."""
        self.planner = MessagePlanner(tokenizer, config)
        self._added_tokens = {
            token.content: token_id
            for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if len(token.content) > 1
        }
        """Markers that are one token (``<tool_call>``, ``</think>``) by their text: grammars name them by id."""

    @property
    def model_name(self) -> str:
        """The model's id."""
        return self.served_names.model_names[0]

    def remote_images(self, body: RequestBody) -> list[tuple[str, str]]:
        """The image URLs ``body`` names that are fetched over the network, each with its field: what to ``fetch``
        before it is prepared."""
        if isinstance(body, ResponseRequest):
            count, urls = response_images(body)
        elif isinstance(body, ChatCompletionRequest):
            parts = image_parts(body)
            count, urls = len(parts), part_urls(parts)
        else:
            return []
        if self.images.processor is None or count > self.images.limits.max_images:
            return []  # refused as it is prepared, nothing fetched for it
        return self.images.sources.remote(urls)

    def prepare(
        self,
        body: RequestBody,
        *,
        request_id: str,
        defaults: BatchDefaults,
        online: bool = False,
        fetched: Fetched | None = None,
    ) -> PreparedRequest:
        """``body`` ready to run: one engine request per prompt (chat: one; completions/embeddings: one per
        prompt/input), in prompt order; ``online`` ones are interactive (scheduled ahead of batch work) and may
        stream; ``fetched``: its remote images, fetched already. ``body`` has passed ``batchgen.schemas.validation``
        (its types, ``request_problem``; a batch line's ``stream`` is refused there)."""
        lora = self._adapter(body.model)
        sequences = sequences_of(body)
        if sequences > self.max_sequences and not isinstance(body, PoolingBody):  # those count their documents
            raise RequestRejected(
                "too_many_sequences",
                f"The request asks for {sequences} sequences (prompts x n); this server runs at most "
                f"{self.max_sequences} for one request. Split it into several requests.",
            )
        if (name := unsupported_parameter(body)) is not None:
            raise RequestRejected(
                "unsupported_parameter",
                f"The parameter {name!r} is not supported by this server; remove it (docs/api.md lists the "
                "parameters it honours).",
                name,
            )
        if not isinstance(body, ResponseRequest):
            return self._prepare(body, body, request_id, defaults, online, lora, fetched)
        translation = translate(body)  # it runs as its chat request, translated here once
        try:
            return self._prepare(body, translation.chat, request_id, defaults, online, lora, fetched)
        except RequestRejected as exc:  # named by the response's own fields
            exc.param = None if exc.param is None else translation.field(exc.param)
            raise

    def check_endpoint(self, path: str) -> None:
        """400 ``unsupported_endpoint`` where the model serves no request to ``path``: a batch's endpoint is checked
        when the batch is created, rather than failing each of its lines."""
        if BODY_TYPES[path] in ENDPOINT_NAMES:  # a pooling endpoint
            self.pooling.check_endpoint(path, self.model_name)
            return
        self._check_generates(path)
        if path != "/v1/completions":
            check_chat_template(self.tokenizer, self.model_name)

    def _check_generates(self, path: str) -> None:
        if "generate" not in self.tasks:
            spec = self.pooling.spec
            raise RequestRejected(
                "unsupported_endpoint",
                f"model {self.model_name!r} is {KINDS[spec.kind]}: it serves {', '.join(spec.endpoints)}, not {path}",
            )

    def _prepare(
        self,
        body: RequestBody,
        runs_as: RunnableBody,
        request_id: str,
        defaults: BatchDefaults,
        online: bool,
        lora: LoRARequest | None,
        fetched: Fetched | None,
    ) -> PreparedRequest:
        if isinstance(runs_as, PoolingBody):
            requests = self.pooling.prepare(runs_as, request_id, online, lora)
            self._check_token_ids("input", [request.prompt_token_ids for request in requests])
            return PreparedRequest(body, runs_as, request_id, requests)
        if isinstance(runs_as, EmbeddingRequest):
            self.pooling.check_endpoint("/v1/embeddings", self.model_name)
            prompts = self.pooling.embedding_prompts(runs_as, first_set(runs_as.add_special_tokens, True))
            self._check_token_ids("input", prompts)
            requests = [
                EngineRequest(engine_request_id(request_id, i), ids, task="embed", interactive=online, lora=lora)
                for i, ids in enumerate(prompts)
            ]
            return PreparedRequest(body, runs_as, request_id, requests)
        self._check_generates(
            "/v1/chat/completions" if isinstance(runs_as, ChatCompletionRequest) else "/v1/completions"
        )
        params = sampling_params(runs_as, defaults, self.generation_defaults, self._added_tokens)
        plan = None
        multimodal = None
        if isinstance(runs_as, ChatCompletionRequest):
            parts = self.images.check(runs_as, self.model_name)
            text = render_chat(self.tokenizer, runs_as, self.model_name)
            prompt_param = "messages"
            if parts:  # the processor expands each image's marker to its placeholders
                ids, multimodal = self.images.prompt(text, parts, fetched=fetched)
                prompts = [ids]
            else:
                prompts = [self.prompts.tokenize(text, prompt_param, first_set(runs_as.add_special_tokens, False))]
            plan = self.planner.plan(runs_as, prompts[0])
            if plan.parses:
                params = dataclasses.replace(
                    params,
                    skip_special_tokens=params.skip_special_tokens and not self.planner.keep_special_tokens,
                    grammar_after=plan.grammar_after if params.grammar is not None else (),
                )
        else:
            prompt_param = "prompt"
            prompts = self.prompts.prompts(runs_as.prompt, prompt_param, first_set(runs_as.add_special_tokens, True))
        self._check_token_ids(prompt_param, prompts, params)
        self._check_scoring_size(runs_as, prompts)
        requests = [
            EngineRequest(
                engine_request_id(request_id, i),
                ids,
                params=params,
                interactive=online,
                stream=online and bool(runs_as.stream),
                lora=lora,
                multimodal=multimodal,
            )
            for i, ids in enumerate(prompts)
        ]
        return PreparedRequest(body, runs_as, request_id, requests, plan)

    def _adapter(self, model: str) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (``None``: the base model); 404 for a name not served."""
        names, adapters = self.served_names.model_names, self.served_names.adapters
        if model in names:
            return None
        if adapters is not None and (lora := adapters.get(model)) is not None:
            return lora
        served = [*names, *(adapters.names() if adapters is not None else ())]
        listed = " or ".join(map(repr, served[:NAMES_LISTED]))
        if len(served) > NAMES_LISTED:
            listed += f" and {len(served) - NAMES_LISTED} more (GET /v1/models lists them)"
        raise RequestRejected(
            "model_not_found",
            f"The model {model[:MAX_NAME_CHARS]!r} does not exist: this server serves {listed}.",
            "model",
            status_code=404,
        )

    def _check_token_ids(
        self, prompt_param: str, prompts: list[list[int]], params: SamplingParams | None = None
    ) -> None:
        """Every token id the request names (its prompts', ``stop_token_ids``, ``logit_bias``) is one the model has:
        the rule the engine's admission keeps too, refused here by the request's own field."""
        named: list[tuple[str, Collection[int]]] = [(prompt_param, prompt) for prompt in prompts]
        if params is not None:
            named += [("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)]
        for param, token_ids in named:
            if (problem := vocabulary_problem(param, token_ids, self.vocab_size)) is not None:
                raise RequestRejected("invalid_value", problem, param)

    def _check_scoring_size(self, body: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]]) -> None:
        """A request whose prompt logprobs would make an answer of tens of megabytes is refused before it runs."""
        entries = prompt_logprob_entries(body, prompts)
        if entries > self.max_prompt_logprob_entries:
            param = "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs"
            raise RequestRejected(
                "too_many_logprobs",
                f"The request asks for {entries} prompt logprobs (prompt tokens x (top logprobs + 1) x n); this server "
                f"returns at most {self.max_prompt_logprob_entries} for one request (--max-prompt-logprob-entries). "
                "Ask for fewer top logprobs, or split the prompts over several requests.",
                param,
            )
