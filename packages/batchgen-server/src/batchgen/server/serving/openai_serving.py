"""Turn an OpenAI request body (a batch input line's, or an online request's) into engine requests, and engine
results into its response body or output line."""

from __future__ import annotations

import base64
import dataclasses
import math
import struct
import time
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from batchgen.schemas import (
    BatchInputLine,
    BatchOutputLine,
    BatchResponse,
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionTokensDetails,
    CompletionUsage,
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    ErrorDetail,
    ErrorResponse,
    GenerationDefaults,
    NamedToolChoice,
    PromptTokensDetails,
    RequestBody,
    Response,
    ResponseRequest,
    TextCompletion,
    TokenLogprob,
    TopLogprob,
    sequences_of,
    unsupported_parameter,
)
from batchgen.schemas.responses_api import chat_request, response_field

from ..engine.adapters import Adapters, LoRARequest, ServedNames
from ..engine.request import EngineError, EngineRequest, EngineResult, SamplingParams, Task
from ..engine.request import TokenLogprob as EngineTokenLogprob
from ..ids import engine_request_id, new_line_id
from .chat_template import render_chat
from .config import ServingConfig
from .errors import RequestRejected
from .messages import MessagePlan, MessageReader
from .parsers import reasoning_parser, tool_call_parser
from .responses import response_object
from .scoring import (
    echoed,
    engine_max_tokens,
    prompt_logprob_entries,
    prompt_logprobs_count,
    wants_ranks,
    wire_prompt_logprobs,
)
from .structured import output_constraint

if TYPE_CHECKING:
    from ..engine.config import EngineConfig
    from ..engine.interface import ServedModel

DEFAULT_MAX_SEQUENCES = 256
PROMPT_TAIL_TOKENS = 32
"""The prompt's last tokens, as text, tell a reasoning parser whether the template opened or closed the thinking."""
ResponseBody = ChatCompletion | TextCompletion | EmbeddingList | Response


class BatchDefaults(GenerationDefaults, kw_only=True):
    """The schemas' batch-level defaults (a batchgen extension); values set on a request override them."""

    @classmethod
    def of(cls, source: object) -> BatchDefaults:
        """The defaults carried by anything with these attributes: a ``BatchObject``, parsed CLI arguments."""
        return cls(**{name: getattr(source, name) for name in GenerationDefaults.__struct_fields__})


class OpenAIServing:
    def __init__(
        self,
        tokenizer: Any,
        model_names: tuple[str, ...],
        max_context_length: int,
        tasks: frozenset[Task] = frozenset({"generate", "embed"}),
        max_sequences: int = DEFAULT_MAX_SEQUENCES,
        generation_defaults: Mapping[str, Any] | None = None,
        config: ServingConfig = ServingConfig(),  # noqa: B008 (frozen)
        adapters: Adapters | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.adapters = adapters
        """The LoRA adapters served beside the model, which a request's ``model`` may name (``--lora-modules``)."""
        self.served_names = ServedNames(model_names, adapters)
        self.model_names = model_names
        """The names requests may use for the model, its id first (``--served-model-name``)."""
        self.max_context_length = max_context_length
        self.tasks = tasks
        """What the engine runs (``engine.tasks``): an encoder model only embeds."""
        self.max_sequences = max_sequences
        """Most sequences (prompts x n) one request may ask for; a request over it is rejected before tokenizing."""
        self.generation_defaults = dict(generation_defaults or {})
        """The model's sampling defaults by request field (``--generation-config``), beneath a batch's own."""
        self.max_prompt_chars = max_context_length * max(map(len, tokenizer.get_vocab()), default=1)
        """A text prompt longer than this cannot fit the context: every token covers at most as many characters as
        the longest entry of the vocabulary (unless the tokenizer's normalizer drops characters). Checked before
        tokenizing, which takes memory and time in proportion to the text."""
        self._token_text = lru_cache(maxsize=65536)(self._decode_token)
        self.max_prompt_logprob_entries = config.max_prompt_logprob_entries
        self.reasoning = None if config.reasoning_parser is None else reasoning_parser(config.reasoning_parser)
        """Splits a thinking model's reasoning from its answer (``--reasoning-parser``)."""
        self.tool_parser = None
        """Parses tool calls out of the text of a ``tool_choice: auto`` request (``--enable-auto-tool-choice``)."""
        if config.enable_auto_tool_choice and config.tool_call_parser is not None:
            self.tool_parser = tool_call_parser(config.tool_call_parser)
        self._reasoning_end_ids: tuple[int, ...] = ()
        if self.reasoning is not None:
            self._reasoning_end_ids = tuple(tokenizer.encode(self.reasoning.end, add_special_tokens=False))
        self._added_tokens = {
            token.content: token_id
            for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if len(token.content) > 1
        }
        """Markers that are one token (``<tool_call>``, ``</think>``) by their text: grammars name them by id."""
        special = set(getattr(tokenizer, "all_special_tokens", ()))
        parsers = [parser for parser in (self.reasoning, self.tool_parser) if parser is not None]
        self._keep_special_tokens = any(marker in special for parser in parsers for marker in parser.markers)
        """A parser's marker is a special token: the text must keep them for the parser to see it."""

    @classmethod
    def for_engine(
        cls,
        engine: ServedModel,
        config: EngineConfig,
        serving: ServingConfig = ServingConfig(),  # noqa: B008 (frozen)
        max_sequences: int = DEFAULT_MAX_SEQUENCES,
    ) -> OpenAIServing:
        """The serving of a loaded engine: under the names ``config`` serves it by, with its generation config's
        defaults, reading chat outputs as ``serving`` says."""
        from ..engine.loader import load_generation_defaults  # transformers: only once a model is loaded

        return cls(
            engine.tokenizer,
            config.served_model_names,
            engine.max_context_length,
            engine.tasks,
            max_sequences,
            load_generation_defaults(config),
            serving,
            Adapters.of(config) if config.enable_lora else None,
        )

    @property
    def model_name(self) -> str:
        """The model's id."""
        return self.model_names[0]

    # ---- request body -> engine requests ------------------------------------------------------------------------

    def to_engine_requests(
        self, body: RequestBody, *, request_id: str, defaults: BatchDefaults, online: bool = False
    ) -> list[EngineRequest]:
        """One engine request per prompt (chat: one; completions/embeddings: one per prompt/input), in prompt order;
        ``online`` ones are interactive (scheduled ahead of batch work) and may stream. ``body`` has passed
        ``batchgen.schemas.validation`` (its types, ``request_problem``; a batch line's ``stream`` is refused there).

        ``output_line`` and ``response_body`` take their results in the same order.
        """
        lora = self._adapter(body.model)
        sequences = sequences_of(body)
        if sequences > self.max_sequences:
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
        if isinstance(body, ResponseRequest):  # runs as its chat request; its errors name the response's fields
            try:
                return self.to_engine_requests(
                    chat_request(body), request_id=request_id, defaults=defaults, online=online
                )
            except RequestRejected as exc:
                exc.param = None if exc.param is None else response_field(exc.param)
                raise
        if isinstance(body, EmbeddingRequest):
            prompts = self._prompts(body.input, "input", _first(body.add_special_tokens, True))
            return [
                EngineRequest(engine_request_id(request_id, i), ids, task="embed", interactive=online, lora=lora)
                for i, ids in enumerate(prompts)
            ]
        if "generate" not in self.tasks:
            url = "/v1/chat/completions" if isinstance(body, ChatCompletionRequest) else "/v1/completions"
            raise RequestRejected(
                "unsupported_endpoint",
                f"model {self.model_name!r} is an embedding model: it serves /v1/embeddings only, not {url}",
            )
        params = self._sampling_params(body, defaults)
        if isinstance(body, ChatCompletionRequest):
            text = render_chat(self.tokenizer, body, self.model_name)
            prompts = [self._tokenize(text, "messages", _first(body.add_special_tokens, False))]
            plan = self.message_plan(body, prompts[0])
            if plan.reasoning is not None or plan.tool_parser is not None:
                params = dataclasses.replace(
                    params,
                    skip_special_tokens=params.skip_special_tokens and not self._keep_special_tokens,
                    grammar_after=self._grammar_after(plan) if params.grammar is not None else (),
                )
        else:
            prompts = self._prompts(body.prompt, "prompt", _first(body.add_special_tokens, True))
        self._check_scoring_size(body, prompts)
        return [
            EngineRequest(
                engine_request_id(request_id, i),
                ids,
                params=params,
                interactive=online,
                stream=online and bool(body.stream),
                lora=lora,
            )
            for i, ids in enumerate(prompts)
        ]

    def _adapter(self, model: str) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (``None``: the base model); 404 for a name not served."""
        if model in self.model_names:
            return None
        if self.adapters is not None and (lora := self.adapters.get(model)) is not None:
            return lora
        names = [*self.model_names, *(self.adapters.names() if self.adapters is not None else ())]
        raise RequestRejected(
            "model_not_found",
            f"The model {model!r} does not exist: this server serves {' or '.join(map(repr, names))}.",
            "model",
            status_code=404,
        )

    def _sampling_params(
        self, body: ChatCompletionRequest | CompletionRequest, defaults: BatchDefaults
    ) -> SamplingParams:
        """The request's values, else the batch's defaults, else the model's generation config's, else batchgen's
        (greedy, no limit but the context)."""
        logprobs, top_logprobs = False, 0
        max_tokens = body.max_tokens
        if isinstance(body, ChatCompletionRequest):
            logprobs, top_logprobs = bool(body.logprobs), body.top_logprobs or 0
            if body.max_completion_tokens is not None:
                max_tokens = body.max_completion_tokens
        elif body.logprobs is not None:
            logprobs, top_logprobs = True, body.logprobs
        model = self.generation_defaults
        max_tokens = _first(max_tokens, defaults.max_decoding_length, model.get("max_tokens"), None)
        if body.min_tokens and max_tokens is not None and body.min_tokens > max_tokens:
            raise RequestRejected(
                "invalid_value", f"min_tokens {body.min_tokens} is more than max_tokens {max_tokens}", "min_tokens"
            )
        max_tokens = engine_max_tokens(max_tokens)
        constraint = output_constraint(body, defaults.response_format, self._added_tokens)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        logit_bias = {int(token): bias for token, bias in (body.logit_bias or {}).items()}
        self._check_token_ids(logit_bias, "logit_bias")
        self._check_token_ids(body.stop_token_ids or (), "stop_token_ids")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_first(body.temperature, defaults.temperature, model.get("temperature"), 0.0),
            top_p=_first(body.top_p, defaults.top_p, model.get("top_p"), 1.0),
            top_k=max(_first(body.top_k, defaults.top_k, model.get("top_k"), 0), 0),
            min_p=_first(body.min_p, model.get("min_p"), 0.0),
            seed=body.seed,
            n=body.n,
            stop=tuple(s for s in stop if s),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens or 0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=_first(body.repetition_penalty, model.get("repetition_penalty"), 1.0),
            logit_bias=logit_bias,
            skip_special_tokens=body.skip_special_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs_count(body),
            prompt_ranks=wants_ranks(body),
            max_context_length=defaults.max_context_length,
            grammar=None if constraint is None else constraint.grammar,
        )

    def message_plan(self, body: ChatCompletionRequest, prompt: list[int]) -> MessagePlan:
        """How the choices of ``body`` (whose prompt is ``prompt``) are read."""
        forced: str | None = "required" if body.tools and body.tool_choice == "required" else None
        if isinstance(body.tool_choice, NamedToolChoice):
            forced = body.tool_choice.function.name
        parses_tools = body.tools and body.tool_choice in (None, "auto") and self.tool_parser is not None
        return MessagePlan(
            prompt_tail=str(self.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)),
            reasoning=self.reasoning,
            reasoning_end_ids=self._reasoning_end_ids,
            tool_parser=self.tool_parser if parses_tools else None,
            tool_names=frozenset(tool.function.name for tool in body.tools or ()),
            forced=forced,
        )

    def _grammar_after(self, plan: MessagePlan) -> tuple[int, ...]:
        """A reasoning model's grammar constrains its answer, after its reasoning ends (as vLLM has it); from the
        first token when the prompt has closed the reasoning already (thinking disabled)."""
        if plan.reasoning is None or plan.prompt_tail.rstrip().endswith(plan.reasoning.end):
            return ()
        return self._reasoning_end_ids

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

    def _check_token_ids(self, token_ids: Any, param: str) -> None:
        bad = [token for token in token_ids if token >= len(self.tokenizer)]
        if bad:
            raise RequestRejected("invalid_value", f"{param} has token ids outside the vocabulary: {bad[:5]}", param)

    def _prompts(self, prompt: str | list[Any], param: str, add_special_tokens: bool) -> list[list[int]]:
        """Text, a list of texts, a list of token ids, or a list of token-id lists -> token-id lists."""
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            items = [prompt]
        else:
            items = prompt
        if not items:
            raise RequestRejected("invalid_value", f"{param} must not be empty", param)
        prompts = []
        for item in items:
            if isinstance(item, str):
                ids = self._tokenize(item, param, add_special_tokens)
            elif isinstance(item, list) and all(isinstance(t, int) for t in item):
                bad = [t for t in item if not 0 <= t < len(self.tokenizer)]
                if bad:
                    raise RequestRejected(
                        "invalid_value", f"{param} has token ids outside the vocabulary: {bad[:5]}", param
                    )
                ids = item
            else:
                raise RequestRejected(
                    "invalid_type", f"{param} must be text, texts, token ids or token-id lists", param
                )
            if not ids:
                raise RequestRejected("invalid_value", f"{param} must not be empty", param)
            prompts.append(ids)
        return prompts

    def _tokenize(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        if len(text) > self.max_prompt_chars:
            raise RequestRejected(
                "context_length_exceeded",
                f"'{param}' has {len(text)} characters: more than the model's context of {self.max_context_length} "
                f"tokens can hold (at most {self.max_prompt_chars} characters with this tokenizer).",
                param,
            )
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    # ---- engine results -> response body, output line ---------------------------------------------------------

    def response_body(
        self, body: RequestBody, requests: list[EngineRequest], results: list[EngineResult], *, request_id: str
    ) -> ResponseBody:
        """The 200 body of a request whose results (in the order of its engine ``requests``) all succeeded."""
        if isinstance(body, EmbeddingRequest):
            return self._embedding_list(body, results)
        if isinstance(body, ResponseRequest):
            chat = self.response_body(chat_request(body), requests, results, request_id=request_id)
            assert isinstance(chat, ChatCompletion)
            return response_object(body, chat, request_id)
        if isinstance(body, ChatCompletionRequest):
            plan = self.message_plan(body, list(requests[0].prompt_token_ids))
            chat = self._chat_completion(body.model, plan, results[0], request_id)
            if body.prompt_logprobs is not None:
                chat.prompt_logprobs = wire_prompt_logprobs(
                    results[0].prompt_logprobs, body.prompt_logprobs, self._token_text
                )
            return chat
        return self._text_completion(body, requests, results, request_id)

    def output_line(
        self, line: BatchInputLine, requests: list[EngineRequest], results: list[EngineResult], *, request_id: str
    ) -> BatchOutputLine:
        """The 200 line, or an error line if any result failed; ``results`` in the order of the engine requests."""
        if (failure := failed(results)) is not None:
            status, error = failure
            return self.error_line(
                line.custom_id, request_id=request_id, code=error.code, message=error.message, status_code=status
            )
        body = self.response_body(line.body, requests, results, request_id=request_id)
        return BatchOutputLine(
            id=new_line_id(),
            custom_id=line.custom_id,
            response=BatchResponse(status_code=200, request_id=request_id, body=body),
            error=None,
        )

    def error_line(
        self,
        custom_id: str,
        *,
        request_id: str,
        code: str,
        message: str,
        param: str | None = None,
        status_code: int = 400,
    ) -> BatchOutputLine:
        error_type = "server_error" if status_code >= 500 else "invalid_request_error"
        detail = ErrorDetail(message=message, type=error_type, param=param, code=code)
        return BatchOutputLine(
            id=new_line_id(),
            custom_id=custom_id,
            response=BatchResponse(status_code=status_code, request_id=request_id, body=ErrorResponse(error=detail)),
            error=None,
        )

    def _chat_completion(self, model: str, plan: MessagePlan, result: EngineResult, request_id: str) -> ChatCompletion:
        choices, reasoning_tokens = [], 0
        for output in result.outputs:
            reader = MessageReader(plan)
            message = reader.message(output.text)
            reasoning_tokens += reader.reasoning_tokens(output.token_ids)
            choices.append(
                ChatCompletionChoice(
                    index=output.index,
                    message=message,
                    logprobs=self.chat_logprobs(output.logprobs),
                    finish_reason=reader.finish_reason(output.finish_reason or "length"),
                )
            )
        return ChatCompletion(
            id=f"chatcmpl-{request_id}",
            created=int(time.time()),
            model=model,
            choices=choices,
            usage=usage([result], reasoning_tokens),
        )

    def _text_completion(
        self, body: CompletionRequest, requests: list[EngineRequest], results: list[EngineResult], request_id: str
    ) -> TextCompletion:
        choices = []
        for prompt_index, (request, result) in enumerate(zip(requests, results, strict=True)):
            prompt_text = self._prompt_text(request) if body.echo else ""
            for output in result.outputs:
                text, token_ids = output.text, None
                logprobs: Sequence[EngineTokenLogprob | None] | None = output.logprobs
                if body.echo:
                    text, token_ids, logprobs = echoed(body, request.prompt_token_ids, result, output, prompt_text)
                choice = CompletionChoice(
                    index=prompt_index * len(result.outputs) + output.index,
                    text=text,
                    logprobs=self.completion_logprobs(logprobs, token_ids=token_ids),
                    finish_reason=output.finish_reason or "length",
                )
                if body.prompt_logprobs is not None:
                    choice.prompt_logprobs = wire_prompt_logprobs(
                        result.prompt_logprobs, body.prompt_logprobs, self._token_text
                    )
                choices.append(choice)
        return TextCompletion(
            id=f"cmpl-{request_id}", created=int(time.time()), model=body.model, choices=choices, usage=usage(results)
        )

    def _prompt_text(self, request: EngineRequest) -> str:
        """An echoed prompt's text: its tokens decoded (as vLLM does for a prompt of token ids)."""
        return str(
            self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=request.params.skip_special_tokens)
        )

    def _embedding_list(self, body: EmbeddingRequest, results: list[EngineResult]) -> EmbeddingList:
        data = []
        for index, result in enumerate(results):
            vector = result.embedding or []
            if body.dimensions is not None and body.dimensions < len(vector):
                vector = vector[: body.dimensions]
                norm = math.sqrt(sum(x * x for x in vector)) or 1.0
                vector = [x / norm for x in vector]
            encoded: list[float] | str = vector
            if body.encoding_format == "base64":
                encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
            data.append(Embedding(index=index, embedding=encoded))
        prompt_tokens = sum(r.prompt_tokens for r in results)
        return EmbeddingList(
            data=data,
            model=body.model,
            usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        )

    def _decode_token(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def chat_logprobs(self, logprobs: list[EngineTokenLogprob] | None) -> ChoiceLogprobs | None:
        if logprobs is None:
            return None
        content = []
        for lp in logprobs:
            text = self._token_text(lp.token_id)
            top = [TopLogprob(token=(t := self._token_text(i)), bytes=list(t.encode()), logprob=v) for i, v in lp.top]
            content.append(TokenLogprob(token=text, bytes=list(text.encode()), logprob=lp.logprob, top_logprobs=top))
        return ChoiceLogprobs(content=content)

    def _top_by_text(self, top: tuple[tuple[int, float], ...]) -> dict[str, float]:
        """Top logprobs keyed by token text, most likely first; tokens that decode alike (the bytes of a split
        character) keep the likeliest's value, so the largest value is always the top token's."""
        by_text: dict[str, float] = {}
        for token_id, value in top:
            by_text.setdefault(self._token_text(token_id), value)
        return by_text

    def completion_logprobs(
        self,
        logprobs: Sequence[EngineTokenLogprob | None] | None,
        offset: int = 0,
        token_ids: list[int] | None = None,
    ) -> CompletionLogprobs | None:
        """``text_offset`` counts from ``offset`` (where a streamed chunk's tokens start in the choice's text). An
        entry is ``None`` only for an echoed prompt's first token: ``token_ids`` then name every entry's token."""
        if logprobs is None:
            return None
        if token_ids is None:
            token_ids = [lp.token_id for lp in logprobs if lp is not None]
        tokens = [self._token_text(token_id) for token_id in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[None if lp is None else lp.logprob for lp in logprobs],
            top_logprobs=[None if lp is None else self._top_by_text(lp.top) for lp in logprobs],
            text_offset=offsets,
        )


def failed(results: list[EngineResult]) -> tuple[int, EngineError] | None:
    """The first failure among a request's results, with its status (500 for the engine's own failure, else 400)."""
    for result in results:
        if result.error is not None:
            return (500 if result.error.code == "server_error" else 400), result.error
    return None


def _first(*values: Any) -> Any:
    """The first value that is set; the last one if none is."""
    return next((v for v in values if v is not None), values[-1])


def usage(results: list[EngineResult], reasoning_tokens: int = 0) -> CompletionUsage:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    return CompletionUsage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning_tokens),
    )
