"""A streamed request's server-sent events, as OpenAI sends them: for a chat, each choice's role first; then chunks of
new text (one choice each) as the engine produces it; each choice's ``finish_reason`` when it ends; with
``stream_options.include_usage``, ``"usage": null`` in those and a last chunk with the totals and no choices; then
``data: [DONE]``."""

from __future__ import annotations

import time
from collections import defaultdict

import msgspec

from batchgen.schemas import (
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChoiceDelta,
    CompletionChunkChoice,
    CompletionRequest,
    CompletionUsage,
    ErrorDetail,
    ErrorResponse,
    TextCompletionChunk,
)
from batchgen.schemas.responses import FinishReason

from ..engine.request import CompletionOutput, EngineResult
from .answers import usage
from .logprobs import LogprobFormatter
from .messages import MessageReader
from .preparing import PreparedRequest

DONE = b"data: [DONE]\n\n"
Chunk = ChatCompletionChunk | TextCompletionChunk
_encode = msgspec.json.Encoder().encode


def event(payload: msgspec.Struct) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


def error_event(code: str, message: str, status_code: int) -> bytes:
    """An error in the middle of a stream (the status is sent already): the error envelope as an event."""
    error_type = "server_error" if status_code >= 500 else "invalid_request_error"
    return event(ErrorResponse(error=ErrorDetail(message=message, type=error_type, param=None, code=code)))


class StreamedResponse:
    """Turns one streamed request's engine results, partial and final, into its events."""

    def __init__(self, prepared: PreparedRequest, logprobs: LogprobFormatter) -> None:
        body = prepared.runs_as
        assert isinstance(body, ChatCompletionRequest | CompletionRequest)  # validated: nothing else streams
        self._logprobs = logprobs
        self._body = body
        self._chat = isinstance(body, ChatCompletionRequest)
        self._readers: dict[int, MessageReader] = {}
        """Each chat choice's reader (its reasoning and tool calls), made on its first text."""
        if prepared.plan is not None:
            self._plan = prepared.plan
        request_id = prepared.request_id
        self._id = f"chatcmpl-{request_id}" if self._chat else f"cmpl-{request_id}"
        self._created = int(time.time())
        options = body.stream_options
        self._usage = options is not None and options.include_usage
        self._continuous = self._usage and options is not None and options.continuous_usage_stats
        self._sent_chars: defaultdict[int, int] = defaultdict(int)
        self._sent_tokens: defaultdict[int, int] = defaultdict(int)
        self._logprob_chars: defaultdict[int, int] = defaultdict(int)
        self._ended: set[int] = set()
        self._results: dict[int, EngineResult] = {}
        """The latest result of each prompt: its prompt tokens, and once final its usage."""

    def start(self) -> list[bytes]:
        """A chat's opening events: each choice's role (a completion has none)."""
        return list(map(event, self.start_chunks()))

    def add(self, prompt_index: int, result: EngineResult) -> list[bytes]:
        """The events of one engine result: a partial one holds what is new, a final one everything (the rest of
        each choice is sent, and its end)."""
        return list(map(event, self.add_chunks(prompt_index, result)))

    def end(self) -> list[bytes]:
        """The usage chunk when asked for, then ``[DONE]``."""
        return [*map(event, self.end_chunks()), DONE]

    def error(self, code: str, message: str, status_code: int) -> list[bytes]:
        return [error_event(code, message, status_code), DONE]

    def start_chunks(self) -> list[Chunk]:
        if not self._chat:
            return []
        opening = ChoiceDelta(role="assistant", content="")
        return [self._chunk(ChatCompletionChunkChoice(index=choice, delta=opening)) for choice in range(self._body.n)]

    def add_chunks(self, prompt_index: int, result: EngineResult) -> list[Chunk]:
        self._results[prompt_index] = result
        chunks = []
        for output in result.outputs:
            choice = prompt_index * self._body.n + output.index
            if choice not in self._ended and (chunk := self._choice_chunk(choice, output, result.finished)):
                chunks.append(self._chunk(chunk))
        return chunks

    def end_chunks(self) -> list[Chunk]:
        if not self._usage:
            return []
        reasoning = sum(
            self._readers[output.index].reasoning_tokens(output.token_ids)
            for result in self._results.values()
            for output in result.outputs
            if output.index in self._readers and self._chat
        )
        return [self._chunk(None, usage(list(self._results.values()), reasoning))]

    def _choice_chunk(
        self, choice: int, output: CompletionOutput, final: bool
    ) -> ChatCompletionChunkChoice | CompletionChunkChoice | None:
        text, logprobs = output.text, output.logprobs
        finish: FinishReason | None = output.finish_reason
        if final:  # everything: what was not sent yet is the rest
            text = text[self._sent_chars[choice] :]
            logprobs = None if logprobs is None else logprobs[self._sent_tokens[choice] :]
            finish = finish or "length"
            self._sent_tokens[choice] = len(output.token_ids)
        else:
            self._sent_tokens[choice] += len(output.token_ids)
        self._sent_chars[choice] += len(text)
        if finish is not None:
            self._ended.add(choice)
        if not (text or logprobs or finish):
            return None
        if self._chat:
            reader = self._readers.get(choice) or self._readers.setdefault(choice, MessageReader(self._plan))
            read = reader.read(text, final=finish is not None)
            if finish is not None:
                finish = reader.finish_reason(finish)
            delta = ChoiceDelta(
                content=read.content or None,
                reasoning=read.reasoning or None,
                reasoning_content=read.reasoning or None,
                tool_calls=read.tool_calls or None,
            )
            chat_logprobs = self._logprobs.chat(logprobs)
            if delta == ChoiceDelta() and not (chat_logprobs or finish):
                return None
            return ChatCompletionChunkChoice(index=choice, delta=delta, logprobs=chat_logprobs, finish_reason=finish)
        completion_logprobs = self._logprobs.completion(logprobs, self._logprob_chars[choice])
        if completion_logprobs is not None:
            self._logprob_chars[choice] += sum(map(len, completion_logprobs.tokens))
        return CompletionChunkChoice(index=choice, text=text, logprobs=completion_logprobs, finish_reason=finish)

    def _chunk(
        self, choice: ChatCompletionChunkChoice | CompletionChunkChoice | None, totals: CompletionUsage | None = None
    ) -> Chunk:
        """A chunk of one choice, or (``None``) the last one, with the ``totals``."""
        usage = totals if choice is None else self._so_far()
        chunk: ChatCompletionChunk | TextCompletionChunk
        if isinstance(choice, CompletionChunkChoice) or (choice is None and not self._chat):
            chunk = TextCompletionChunk(
                id=self._id,
                created=self._created,
                model=self._body.model,
                choices=[choice] if choice else [],
                usage=usage,
            )
        else:
            chunk = ChatCompletionChunk(
                id=self._id,
                created=self._created,
                model=self._body.model,
                choices=[choice] if choice else [],
                usage=usage,
            )
        return chunk

    def _so_far(self) -> CompletionUsage | msgspec.UnsetType | None:
        """A content chunk's ``usage``: absent unless asked for, then null, or the counts so far (vLLM's
        ``continuous_usage_stats``)."""
        if not self._usage:
            return msgspec.UNSET
        if not self._continuous:
            return None
        prompt = sum(result.prompt_tokens for result in self._results.values())
        completion = sum(self._sent_tokens.values())
        return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
