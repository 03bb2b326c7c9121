"""A prepared request's answer from its engine results: its response body (a chat completion, a text completion,
embeddings, or a response), or a batch line's output line; and the error line of a line that is refused or fails."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from batchgen.schemas import (
    BatchOutputLine,
    BatchResponse,
    ChatCompletion,
    ChatCompletionChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionTokensDetails,
    CompletionUsage,
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    ErrorDetail,
    ErrorResponse,
    PoolingBody,
    PoolingResponseBody,
    PromptTokensDetails,
    Response,
    ResponseRequest,
    TextCompletion,
)

from ..engine.request import EngineError, EngineRequest, EngineResult
from ..engine.request import TokenLogprob as EngineTokenLogprob
from ..ids import new_line_id
from .logprobs import LogprobFormatter
from .messages import MessagePlan, MessageReader
from .pooling import PoolingServing, encode
from .preparing import PreparedRequest
from .responses import response_object
from .scoring import echoed

ResponseBody = ChatCompletion | TextCompletion | EmbeddingList | Response | PoolingResponseBody


class Answers:
    """Makes the answers of prepared requests whose results (in the order of their engine requests) are all in."""

    def __init__(self, tokenizer: Any, logprobs: LogprobFormatter, pooling: PoolingServing) -> None:
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.pooling = pooling

    def response_body(self, prepared: PreparedRequest, results: list[EngineResult]) -> ResponseBody:
        """The 200 body of a request whose results all succeeded."""
        runs_as, request_id = prepared.runs_as, prepared.request_id
        if isinstance(runs_as, PoolingBody):
            return self.pooling.answer(runs_as, request_id, results)
        if isinstance(runs_as, EmbeddingRequest):
            return embedding_list(runs_as, results, self.pooling)
        if isinstance(runs_as, CompletionRequest):
            return self._text_completion(runs_as, prepared.requests, results, request_id)
        assert prepared.plan is not None  # a chat's
        chat = self._chat_completion(runs_as.model, prepared.plan, results[0], request_id)
        if runs_as.prompt_logprobs is not None:
            chat.prompt_logprobs = self.logprobs.prompt(results[0].prompt_logprobs, runs_as.prompt_logprobs)
        if isinstance(prepared.body, ResponseRequest):
            return response_object(prepared.body, chat, request_id)
        return chat

    def output_line(self, custom_id: str, prepared: PreparedRequest, results: list[EngineResult]) -> BatchOutputLine:
        """The 200 line, or an error line if any result failed."""
        request_id = prepared.request_id
        if (failure := failed(results)) is not None:
            status, error = failure
            return error_line(
                custom_id, request_id=request_id, code=error.code, message=error.message, status_code=status
            )
        body = self.response_body(prepared, results)
        return BatchOutputLine(
            id=new_line_id(),
            custom_id=custom_id,
            response=BatchResponse(status_code=200, request_id=request_id, body=body),
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
                    logprobs=self.logprobs.chat(output.logprobs),
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
                    logprobs=self.logprobs.completion(logprobs, token_ids=token_ids),
                    finish_reason=output.finish_reason or "length",
                )
                if body.prompt_logprobs is not None:
                    choice.prompt_logprobs = self.logprobs.prompt(result.prompt_logprobs, body.prompt_logprobs)
                choices.append(choice)
        return TextCompletion(
            id=f"cmpl-{request_id}", created=int(time.time()), model=body.model, choices=choices, usage=usage(results)
        )

    def _prompt_text(self, request: EngineRequest) -> str:
        """An echoed prompt's text: its tokens decoded (as vLLM does for a prompt of token ids)."""
        return str(
            self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=request.params.skip_special_tokens)
        )


def embedding_list(body: EmbeddingRequest, results: list[EngineResult], pooling: PoolingServing) -> EmbeddingList:
    data = []
    for index, result in enumerate(results):
        vector = pooling.truncated(result.embedding or [], body.dimensions)
        data.append(Embedding(index=index, embedding=encode(vector, body.encoding_format)))
    prompt_tokens = sum(r.prompt_tokens for r in results)
    return EmbeddingList(
        data=data,
        model=body.model,
        usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
    )


def error_line(
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


def failed(results: list[EngineResult]) -> tuple[int, EngineError] | None:
    """The first failure among a request's results, with its status (500 for the engine's own failure, else 400)."""
    for result in results:
        if result.error is not None:
            return (500 if result.error.code == "server_error" else 400), result.error
    return None


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
