"""A streamed response's server-sent events, in OpenAI's order: ``response.created`` and ``response.in_progress``;
then each output item as the chat stream it runs as produces it (``output_item.added``; for the reasoning and the
message a content part, its text deltas and their ``done``; for a function call its arguments' deltas and
``done``; ``output_item.done``); last ``response.completed`` (``response.incomplete`` when cut short) with the whole
response. Each event carries its ``type`` as the SSE event name too, and a ``sequence_number``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from batchgen.schemas import ResponseRequest
from batchgen.schemas.responses import (
    ChatCompletionChunkChoice,
    ChoiceDelta,
    CompletionUsage,
    FinishReason,
    FunctionCall,
    ToolCall,
)
from batchgen.schemas.responses_api import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseErrorEvent,
    ResponseEvent,
    ResponseIncomplete,
    ResponseInProgress,
)

from ..engine.request import EngineResult
from .logprobs import LogprobFormatter
from .preparing import PreparedRequest
from .responses import call_item, finished_response, message_item, pending_response, reasoning_item
from .streaming import StreamedResponse

_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class _OpenItem:
    """The output item being streamed: its place, kind and text (or arguments) so far."""

    index: int
    kind: str
    call: ToolCall | None = None
    deltas: list[str] = field(default_factory=list)


class ResponseStream:
    """Turns one streamed response's engine results into its events (through the chat chunks it runs as)."""

    def __init__(self, prepared: PreparedRequest, logprobs: LogprobFormatter) -> None:
        assert isinstance(prepared.body, ResponseRequest)
        self._body, self._request_id = prepared.body, prepared.request_id
        self._chat = StreamedResponse(prepared, logprobs)
        self._created = int(time.time())
        self._sequence = 0
        self._items: list[OutputItem] = []
        self._open: _OpenItem | None = None
        self._finish: FinishReason = "length"
        self._usage: CompletionUsage | None = None

    def start(self) -> list[bytes]:
        self._chat.start_chunks()  # the role: nothing to say
        pending = pending_response(self._body, self._request_id, "in_progress", self._created)
        return [self._event(ResponseCreated, response=pending), self._event(ResponseInProgress, response=pending)]

    def add(self, prompt_index: int, result: EngineResult) -> list[bytes]:
        events: list[bytes] = []
        for chunk in self._chat.add_chunks(prompt_index, result):
            for choice in chunk.choices:
                assert isinstance(choice, ChatCompletionChunkChoice)  # a chat's chunk
                events += self._delta(choice.delta)
                if choice.finish_reason is not None:
                    events += self._close()
                    self._finish = choice.finish_reason
        return events

    def end(self) -> list[bytes]:
        for chunk in self._chat.end_chunks():
            if isinstance(chunk.usage, CompletionUsage):
                self._usage = chunk.usage
        events = self._close()
        response = finished_response(
            self._body, self._request_id, self._items, self._finish, self._usage, self._created
        )
        kind = ResponseIncomplete if response.status == "incomplete" else ResponseCompleted
        return [*events, self._event(kind, response=response)]

    def error(self, code: str, message: str, status_code: int) -> list[bytes]:
        return [self._event(ResponseErrorEvent, code=code, message=message)]

    def _delta(self, delta: ChoiceDelta) -> list[bytes]:
        events: list[bytes] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls or ():
            if call.id is not None:  # a new call: its name comes whole, then its arguments in pieces
                events += self._close()
                name = call.function.name or ""
                tool_call = ToolCall(id=call.id, function=FunctionCall(name=name, arguments=""))
                events += self._open_item("call", call_item(self._request_id, tool_call, "in_progress"), tool_call)
            if (arguments := call.function.arguments) and self._open is not None and self._open.kind == "call":
                self._open.deltas.append(arguments)
                events.append(
                    self._event(
                        FunctionCallArgumentsDelta,
                        item_id=self._item_id(),
                        output_index=self._open.index,
                        delta=arguments,
                    )
                )
        return events

    def _text(self, kind: str, text: str) -> list[bytes]:
        """More reasoning or message text: its item (and content part) opened first if need be."""
        events: list[bytes] = []
        if self._open is None or self._open.kind != kind:
            events += self._close()
            if kind == "reasoning":
                item: OutputItem = reasoning_item(self._request_id, None, "in_progress")
                part: OutputText | ReasoningText = ReasoningText(text="")
            else:
                item = message_item(self._request_id, None, "in_progress")
                part = OutputText(text="")
            events += self._open_item(kind, item)
            events.append(self._event(ContentPartAdded, **self._place(), part=part))
        assert self._open is not None
        self._open.deltas.append(text)
        delta = ReasoningTextDelta if kind == "reasoning" else OutputTextDelta
        return [*events, self._event(delta, **self._place(), delta=text)]

    def _open_item(self, kind: str, item: OutputItem, call: ToolCall | None = None) -> list[bytes]:
        self._open = _OpenItem(index=len(self._items), kind=kind, call=call)
        self._items.append(item)
        return [self._event(OutputItemAdded, output_index=self._open.index, item=item)]

    def _close(self) -> list[bytes]:
        """The ``done`` events of the item being streamed, if any (it is then final in the response)."""
        if (current := self._open) is None:
            return []
        self._open = None
        text = "".join(current.deltas)
        if current.kind == "call":
            assert current.call is not None
            current.call.function.arguments = text
            item: OutputItem = call_item(self._request_id, current.call)
            self._items[current.index] = item
            done = self._event(
                FunctionCallArgumentsDone,
                item_id=item.id,
                output_index=current.index,
                name=current.call.function.name,
                arguments=text,
            )
            return [done, self._event(OutputItemDone, output_index=current.index, item=item)]
        place = {"item_id": self._items[current.index].id, "output_index": current.index, "content_index": 0}
        if current.kind == "reasoning":
            item = reasoning_item(self._request_id, text)
            part: OutputText | ReasoningText = item.content[0]
            text_done = self._event(ReasoningTextDone, **place, text=text)
        else:
            item = message_item(self._request_id, text)
            part = item.content[0]
            text_done = self._event(OutputTextDone, **place, text=text)
        self._items[current.index] = item
        return [
            text_done,
            self._event(ContentPartDone, **place, part=part),
            self._event(OutputItemDone, output_index=current.index, item=item),
        ]

    def _item_id(self) -> str:
        assert self._open is not None
        return self._items[self._open.index].id

    def _place(self) -> dict[str, object]:
        assert self._open is not None
        return {"item_id": self._item_id(), "output_index": self._open.index, "content_index": 0}

    def _event(self, kind: type[ResponseEvent], **fields: object) -> bytes:
        payload = kind(sequence_number=self._sequence, **fields)
        self._sequence += 1
        tag = type(payload).__struct_config__.tag
        return b"event: " + str(tag).encode() + b"\ndata: " + _encode(payload) + b"\n\n"
