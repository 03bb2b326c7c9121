"""Turn one OpenAI batch input line into engine requests, and engine results into its output line."""

from __future__ import annotations

import base64
import math
import struct
import time
from functools import lru_cache
from typing import Any

from batchgen.schemas import (
    BatchInputLine,
    BatchOutputLine,
    BatchResponse,
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionUsage,
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    ErrorDetail,
    ErrorResponse,
    GenerationDefaults,
    PromptTokensDetails,
    TextCompletion,
    TokenLogprob,
    TopLogprob,
    sequences_of,
)

from ..engine.request import EngineRequest, EngineResult, SamplingParams, Task
from ..engine.request import TokenLogprob as EngineTokenLogprob
from ..ids import engine_request_id, new_line_id

DEFAULT_MAX_SEQUENCES = 256


class BatchDefaults(GenerationDefaults, kw_only=True):
    """The schemas' batch-level defaults (a batchgen extension); values set on a request override them."""

    @classmethod
    def of(cls, source: object) -> BatchDefaults:
        """The defaults carried by anything with these attributes: a ``BatchObject``, parsed CLI arguments."""
        return cls(**{name: getattr(source, name) for name in GenerationDefaults.__struct_fields__})


class RequestRejected(Exception):
    """A request the server cannot run as asked; it becomes an error line with status 400."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class OpenAIServing:
    def __init__(
        self,
        tokenizer: Any,
        model_name: str,
        max_context_length: int,
        tasks: frozenset[Task] = frozenset({"generate", "embed"}),
        max_sequences: int = DEFAULT_MAX_SEQUENCES,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context_length = max_context_length
        self.tasks = tasks
        """What the engine runs (``engine.tasks``): an encoder model only embeds."""
        self.max_sequences = max_sequences
        """Most sequences (prompts x n) one request may ask for; a request over it is rejected before tokenizing."""
        self._token_text = lru_cache(maxsize=65536)(self._decode_token)

    # ---- input line -> engine requests -------------------------------------------------------------------------

    def to_engine_requests(
        self, line: BatchInputLine, *, request_id: str, defaults: BatchDefaults, group: str
    ) -> list[EngineRequest]:
        """One engine request per prompt (chat: one; completions/embeddings: one per prompt/input), in prompt order.

        ``output_line`` takes their results in the same order.
        """
        body = line.body
        sequences = sequences_of(body)
        if sequences > self.max_sequences:
            raise RequestRejected(
                "too_many_sequences",
                f"The request asks for {sequences} sequences (prompts x n); this server runs at most "
                f"{self.max_sequences} for one request. Split it into several requests.",
            )
        if isinstance(body, EmbeddingRequest):
            prompts = self._prompts(body.input, "input")
            return [
                EngineRequest(engine_request_id(request_id, i), ids, task="embed", group=group)
                for i, ids in enumerate(prompts)
            ]
        if "generate" not in self.tasks:
            raise RequestRejected(
                "unsupported_endpoint",
                f"model {self.model_name!r} is an embedding model: it serves /v1/embeddings only, not {line.url}",
            )
        params = self._sampling_params(body, defaults)
        if isinstance(body, ChatCompletionRequest):
            prompts = [self._chat_prompt(body)]
        else:
            if body.echo:
                raise RequestRejected("unsupported_parameter", "echo is not supported", "echo")
            prompts = self._prompts(body.prompt, "prompt")
        return [
            EngineRequest(engine_request_id(request_id, i), ids, params=params, group=group)
            for i, ids in enumerate(prompts)
        ]

    def _sampling_params(
        self, body: ChatCompletionRequest | CompletionRequest, defaults: BatchDefaults
    ) -> SamplingParams:
        if body.stream:
            raise RequestRejected("unsupported_parameter", "stream is not supported in a batch", "stream")
        logprobs, top_logprobs = False, 0
        max_tokens = body.max_tokens
        if isinstance(body, ChatCompletionRequest):
            if body.response_format is not None and body.response_format.type != "text":
                raise RequestRejected(
                    "unsupported_parameter",
                    f"response_format {body.response_format.type!r} is not supported; only 'text'",
                    "response_format",
                )
            if body.top_logprobs and not body.logprobs:
                raise RequestRejected("invalid_value", "top_logprobs requires logprobs to be true", "top_logprobs")
            logprobs, top_logprobs = bool(body.logprobs), body.top_logprobs or 0
            if body.max_completion_tokens is not None:
                max_tokens = body.max_completion_tokens
        elif body.logprobs is not None:
            logprobs, top_logprobs = True, body.logprobs
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else defaults.max_decoding_length,
            temperature=_first(body.temperature, defaults.temperature, 0.0),
            top_p=_first(body.top_p, defaults.top_p, 1.0),
            top_k=max(_first(body.top_k, defaults.top_k, 0), 0),
            seed=body.seed,
            n=body.n,
            stop=tuple(s for s in stop if s),
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            max_context_length=defaults.max_context_length,
        )

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise RequestRejected("unsupported_endpoint", f"model {self.model_name!r} has no chat template", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template itself may reject a conversation (e.g. roles out of order)
            raise RequestRejected("invalid_value", f"chat template rejected the messages: {exc}", "messages") from exc
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prompts(self, prompt: str | list[Any], param: str) -> list[list[int]]:
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
                ids = list(self.tokenizer.encode(item))
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

    # ---- engine results -> output line ------------------------------------------------------------------------

    def output_line(self, line: BatchInputLine, results: list[EngineResult], *, request_id: str) -> BatchOutputLine:
        """The 200 line, or an error line if any result failed (status 500 for the engine's own failure, else 400);
        ``results`` in the order of the engine requests."""
        for result in results:
            if result.error is not None:
                error = result.error
                status = 500 if error.code == "server_error" else 400
                return self.error_line(
                    line.custom_id, request_id=request_id, code=error.code, message=error.message, status_code=status
                )
        body: ChatCompletion | TextCompletion | EmbeddingList
        if isinstance(line.body, EmbeddingRequest):
            body = self._embedding_list(line.body, results)
        elif isinstance(line.body, ChatCompletionRequest):
            body = self._chat_completion(results[0], request_id)
        else:
            body = self._text_completion(results, request_id)
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

    def _chat_completion(self, result: EngineResult, request_id: str) -> ChatCompletion:
        choices = [
            ChatCompletionChoice(
                index=output.index,
                message=ChatCompletionMessage(content=output.text),
                logprobs=None
                if output.logprobs is None
                else ChoiceLogprobs(content=self._chat_logprobs(output.logprobs)),
                finish_reason=output.finish_reason,
            )
            for output in result.outputs
        ]
        return ChatCompletion(
            id=f"chatcmpl-{request_id}",
            created=int(time.time()),
            model=self.model_name,
            choices=choices,
            usage=_usage([result]),
        )

    def _text_completion(self, results: list[EngineResult], request_id: str) -> TextCompletion:
        choices = []
        for prompt_index, result in enumerate(results):
            for output in result.outputs:
                logprobs = None if output.logprobs is None else self._completion_logprobs(output.logprobs)
                choices.append(
                    CompletionChoice(
                        index=prompt_index * len(result.outputs) + output.index,
                        text=output.text,
                        logprobs=logprobs,
                        finish_reason=output.finish_reason,
                    )
                )
        return TextCompletion(
            id=f"cmpl-{request_id}",
            created=int(time.time()),
            model=self.model_name,
            choices=choices,
            usage=_usage(results),
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
            model=self.model_name,
            usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        )

    def _decode_token(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def _chat_logprobs(self, logprobs: list[EngineTokenLogprob]) -> list[TokenLogprob]:
        out = []
        for lp in logprobs:
            text = self._token_text(lp.token_id)
            top = [TopLogprob(token=(t := self._token_text(i)), bytes=list(t.encode()), logprob=v) for i, v in lp.top]
            out.append(TokenLogprob(token=text, bytes=list(text.encode()), logprob=lp.logprob, top_logprobs=top))
        return out

    def _completion_logprobs(self, logprobs: list[EngineTokenLogprob]) -> CompletionLogprobs:
        tokens = [self._token_text(lp.token_id) for lp in logprobs]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[lp.logprob for lp in logprobs],
            top_logprobs=[{self._token_text(i): v for i, v in lp.top} for lp in logprobs],
            text_offset=offsets,
        )


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def _usage(results: list[EngineResult]) -> CompletionUsage:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    return CompletionUsage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )
