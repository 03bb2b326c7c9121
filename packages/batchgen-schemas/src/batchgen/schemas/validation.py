"""Streaming validation of batch input files (JSONL), shared by the server and the client.

The file is read in chunks and split into lines, so memory stays bounded by the longest allowed line. Once the
batch's endpoint is known, each line is decoded in one pass with a pre-built decoder for that endpoint's requests; a
line that fails is decoded again in two steps (an envelope whose ``body`` stays raw, then the body) to name its first
problem precisely. Every problem becomes a :class:`LineError` with a 1-based line number and an OpenAI-style
``code``; the validator never raises on bad input.

- :func:`iter_input_lines` yields a typed :class:`~batchgen.schemas.BatchInputLine` or a :class:`LineError` per line.
- :func:`validate_input_file` summarises a whole file into a :class:`ValidationReport`.
- :class:`UploadChecker` / :func:`check_upload` are the cheap upload-time check (UTF-8, one JSON object per line,
  size limits), fed chunk by chunk as an upload streams in.
"""

from __future__ import annotations

import os
import re
from collections.abc import Container, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import compress
from operator import methodcaller, not_
from typing import Annotated, Any, BinaryIO, Generic, NamedTuple, TypeVar

import msgspec

from .batches import BatchError, BatchErrors
from .endpoints import BODY_TYPES, BatchInputLine, RequestBody
from .pooling import ClassificationRequest, PoolingBody, PoolingRequest, pooling_problem
from .requests import (
    CONSTRAINTS,
    INT32_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    FileContentPart,
    ImageContentPart,
    NamedToolChoice,
    Prompt,
    count_sequences,
)
from .responses_api import ResponseInputProblem, ResponseRequest, translate

__all__ = [
    "DEFAULT_LIMITS",
    "LineError",
    "UploadChecker",
    "ValidationLimits",
    "ValidationReport",
    "check_upload",
    "iter_input_lines",
    "request_problem",
    "validate_input_file",
]

_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ValidationLimits:
    max_requests: int = 50_000
    max_line_bytes: int = 8 * 1024 * 1024
    max_file_bytes: int = 200 * 1024 * 1024


DEFAULT_LIMITS = ValidationLimits()


class LineError(msgspec.Struct, frozen=True, kw_only=True):
    """One problem in an input file; ``line`` is 1-based, ``None`` for file-level errors (``empty_file``...)."""

    line: int | None
    code: str
    message: str
    param: str | None = None

    def to_batch_error(self) -> BatchError:
        return BatchError(code=self.code, message=self.message, param=self.param, line=self.line)


class ValidationReport(msgspec.Struct, kw_only=True):
    """Summary of a whole input file: counts, the file's model and endpoint, and its first errors."""

    request_count: int
    """Non-blank lines read (each one is a request, valid or not)."""
    error_count: int
    """Lines with an error, plus file-level errors; ``errors`` holds only the first ones."""
    errors: list[LineError]
    model: str | None
    endpoint: str | None

    @property
    def ok(self) -> bool:
        return self.error_count == 0

    def batch_errors(self) -> BatchErrors | None:
        """The ``errors`` field of a batch that failed validation (``None`` when the file is valid)."""
        return None if self.ok else BatchErrors(data=[e.to_batch_error() for e in self.errors])


Source = BinaryIO | str | os.PathLike[str]


# --- line scanning: chunks -> numbered non-blank lines, with the encoding and size limits -----------------------


class _Lines(NamedTuple):
    """A chunk's worth of scanned lines: each a line's bytes or the error that rejected it, and its number."""

    numbers: list[int]
    lines: list[bytes | LineError]


_IS_OBJECT = methodcaller("startswith", b"{")


class _LineScanner:
    """Splits a byte stream fed in chunks into numbered, non-blank, UTF-8 lines within the limits.

    This is the hot loop, so a chunk whose lines are all usual (start with '{', within the limits, UTF-8) is
    checked at C speed, with no Python code per line; other chunks go line by line. ``file_too_large`` and
    ``too_many_requests`` are fatal: nothing follows them.
    """

    def __init__(self, limits: ValidationLimits) -> None:
        self._limits = limits
        self._line = 0
        self.requests = 0
        """Non-blank lines seen so far."""
        self._bytes = 0
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._overlong = False
        self.stopped = False

    def feed(self, chunk: bytes) -> _Lines:
        if self.stopped:
            return _Lines([], [])
        self._bytes += len(chunk)
        if self._bytes > self._limits.max_file_bytes:
            self.stopped = True
            message = f"The file exceeds the limit of {self._limits.max_file_bytes} bytes."
            return _Lines([0], [LineError(line=None, code="file_too_large", message=message)])
        pieces = chunk.split(b"\n")
        tail = pieces.pop()
        numbers: list[int] = []
        lines: list[bytes | LineError] = []
        if pieces and (self._pending or self._overlong):  # the end of a line that started in an earlier chunk
            self._add(numbers, lines, self._take_pending(pieces.pop(0)))
        if self.stopped:
            return _Lines(numbers, lines)
        if self._all_usual(pieces, len(chunk)):
            numbers += range(self._line + 1, self._line + 1 + len(pieces))
            lines += pieces
            self._line += len(pieces)
            self.requests += len(pieces)
        else:
            for piece in pieces:
                self._add(numbers, lines, piece)
                if self.stopped:
                    return _Lines(numbers, lines)
        self._hold(tail)
        return _Lines(numbers, lines)

    def finish(self) -> _Lines:
        if self.stopped:
            return _Lines([], [])
        numbers: list[int] = []
        lines: list[bytes | LineError] = []
        if self._pending or self._overlong:
            self._add(numbers, lines, self._take_pending(b""))
        if self.requests == 0:
            numbers.append(0)
            lines.append(LineError(line=None, code="empty_file", message="The file contains no requests."))
        return _Lines(numbers, lines)

    def scan(self, source: Source) -> Iterator[_Lines]:
        """The lines of a whole file, a chunk's worth at a time."""
        for chunk in _read_chunks(source):
            yield self.feed(chunk)
            if self.stopped:
                return
        yield self.finish()

    def _all_usual(self, lines: list[bytes], size: int) -> bool:
        """Whether ``_classify`` would pass every line as is (with Python code only for non-ASCII lines); ``size``
        bounds the lines' lengths (the chunk's)."""
        return (
            self.requests + len(lines) <= self._limits.max_requests
            and all(map(_IS_OBJECT, lines))  # so none is blank
            and (size <= self._limits.max_line_bytes or max(map(len, lines), default=0) <= self._limits.max_line_bytes)
            and _utf8_error(b"\n".join(compress(lines, map(not_, map(bytes.isascii, lines))))) is None
        )

    def _add(self, numbers: list[int], lines: list[bytes | LineError], line: bytes | None) -> None:
        self._line += 1
        if (item := self._classify(line)) is not None:
            numbers.append(self._line)
            lines.append(item)

    def _hold(self, tail: bytes) -> None:
        if not tail or self._overlong:
            return
        self._pending.append(tail)
        self._pending_bytes += len(tail)
        if self._pending_bytes > self._limits.max_line_bytes:  # keep memory bounded: drop the line's bytes now
            self._overlong = True
            self._pending.clear()

    def _take_pending(self, piece: bytes) -> bytes | None:
        """The held start of a line joined with its end ``piece``; ``None`` when the line was too long to hold."""
        line = None if self._overlong else b"".join((*self._pending, piece))
        self._pending.clear()
        self._pending_bytes = 0
        self._overlong = False
        return line

    def _classify(self, line: bytes | None) -> bytes | LineError | None:
        """The current line, or the error that rejects it (``line`` is ``None`` when it was too long to hold);
        ``None`` for a blank line."""
        if line is not None and not line.strip():
            return None  # blank lines (a trailing newline, "\r\n" endings) are not requests
        self.requests += 1
        if self.requests > self._limits.max_requests:
            self.stopped = True
            message = f"The file has more than the limit of {self._limits.max_requests} requests."
            return LineError(line=self._line, code="too_many_requests", message=message)
        if line is None or len(line) > self._limits.max_line_bytes:
            message = f"The line exceeds the limit of {self._limits.max_line_bytes} bytes."
            return LineError(line=self._line, code="line_too_long", message=message)
        if not line.isascii() and (error := _utf8_error(line)) is not None:
            return LineError(line=self._line, code="invalid_encoding", message=error)
        return line


def _utf8_error(line: bytes) -> str | None:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"The line is not valid UTF-8 (byte {exc.start + 1})."
    return None


def _read_chunks(source: Source) -> Iterator[bytes]:
    if isinstance(source, str | os.PathLike):
        with open(source, "rb") as file:
            yield from iter(partial(file.read, _CHUNK_BYTES), b"")
    else:
        yield from iter(partial(source.read, _CHUNK_BYTES), b"")


# --- msgspec errors -> LineError ---------------------------------------------------------------------------------

_ERROR_AT = re.compile(r"^(?P<detail>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`$")
_FIELD_ERRORS = (
    (_MISSING, "missing_required_parameter", "Missing required parameter: '{}'."),
    (_UNKNOWN, "unknown_parameter", "Unrecognized request argument supplied: '{}'."),
)


def _decode_error(line: int, exc: Exception, prefix: str) -> LineError:
    """Map a msgspec decode failure of the line (``prefix`` ``""``) or of its body (``"body"``) to a LineError."""
    if isinstance(exc, RecursionError):
        return LineError(line=line, code="invalid_json_line", message="The JSON is nested too deeply.")
    if not isinstance(exc, msgspec.ValidationError):
        return LineError(line=line, code="invalid_json_line", message=f"The line is not valid JSON: {exc}.")
    match = _ERROR_AT.match(str(exc))
    assert match is not None  # the pattern matches any string
    detail, path = match["detail"], (match["path"] or "").replace("[...]", "")  # msgspec's mark for a dict value
    param = f"{prefix}{path}".lstrip(".") or None
    for pattern, code, message in _FIELD_ERRORS:  # a field missing or unknown: name it in full
        if (named := pattern.match(detail)) is not None:
            field = ".".join(p for p in (param, named["field"]) if p)
            return LineError(line=line, code=code, message=message.format(field), param=field)
    if param is None:  # the line itself is valid JSON but not an object
        return LineError(line=line, code="invalid_json_line", message=f"The line must be a JSON object: {detail}.")
    return LineError(line=line, code="invalid_request", message=f"Invalid '{param}': {detail}.", param=param)


# --- request validation -------------------------------------------------------------------------------------------


CustomId = Annotated[str, msgspec.Meta(min_length=1)]
BodyT = TypeVar("BodyT")


class _Envelope(msgspec.Struct, gc=False):
    custom_id: CustomId
    method: str
    url: str
    body: msgspec.Raw


class _Request(msgspec.Struct, Generic[BodyT], gc=False):
    """A whole line of a known endpoint, decoded in one pass: the fast path for lines without errors."""

    custom_id: CustomId
    method: str
    url: str
    body: BodyT


_ENVELOPE = msgspec.json.Decoder(_Envelope)
_BODY_DECODERS: dict[str, msgspec.json.Decoder[RequestBody]] = {
    url: msgspec.json.Decoder(body_type) for url, body_type in BODY_TYPES.items()
}
_REQUEST_DECODERS: dict[str, msgspec.json.Decoder[_Request[RequestBody]]] = {
    url: msgspec.json.Decoder(_Request[body_type])  # type: ignore[valid-type]
    for url, body_type in BODY_TYPES.items()
}


class _RequestValidator:
    """The per-line checks, with the state they need across lines: endpoint, model, unique custom_ids.

    Once the endpoint is known, a line is decoded in one pass; a line that fails it is decoded again in two steps
    (envelope, then body) to report its first problem precisely. ``validate`` is the hot loop.
    """

    def __init__(self, endpoint: str | None, model: str | None, family: Container[str] = ()) -> None:
        if endpoint is not None and endpoint not in BODY_TYPES:
            raise ValueError(f"unsupported endpoint {endpoint!r}; expected one of {sorted(BODY_TYPES)}")
        self.endpoint = endpoint
        self.model = model
        self.family = family
        """Names that may share a file with each other (a base model and its LoRA adapters)."""
        self._model_line: int | None = None
        self._custom_ids: dict[str, int] = {}
        self._decoder = None if endpoint is None else _REQUEST_DECODERS[endpoint]

    def validate(self, scanned: _Lines, *, requests: bool = True) -> Iterator[_Request[RequestBody] | LineError]:
        """Each scanned line's request (only when ``requests``), or its error (the scanner's pass through)."""
        custom_ids, check_body = self._custom_ids, self._check_body
        decoder, endpoint = self._decoder, self.endpoint
        for line, data in zip(*scanned, strict=True):
            if isinstance(data, LineError):
                yield data
                continue
            if decoder is not None:  # the fast path, for lines without errors
                try:
                    request = decoder.decode(data)
                except (msgspec.DecodeError, RecursionError):
                    pass
                else:
                    # Claiming the custom_id is idempotent for a line, so _diagnose may claim it again.
                    if (
                        request.method == "POST"
                        and request.url == endpoint
                        and custom_ids.setdefault(request.custom_id, line) == line
                        and check_body(line, request.body) is None
                    ):
                        if requests:
                            yield request
                        continue
            result = self._diagnose(line, data)
            if requests or isinstance(result, LineError):
                yield result
            decoder, endpoint = self._decoder, self.endpoint

    def _diagnose(self, line: int, data: bytes) -> _Request[RequestBody] | LineError:
        try:
            envelope = _ENVELOPE.decode(data)
        except (msgspec.DecodeError, RecursionError) as exc:
            return _decode_error(line, exc, "")
        if envelope.method != "POST":
            return LineError(
                line=line,
                code="invalid_method",
                message=f"The method must be 'POST', got {envelope.method!r}.",
                param="method",
            )
        decoder = _BODY_DECODERS.get(envelope.url)
        if decoder is None:
            return LineError(
                line=line,
                code="invalid_url",
                message=f"The url {envelope.url!r} is not supported; expected one of {sorted(BODY_TYPES)}.",
                param="url",
            )
        if self.endpoint is None:
            self.endpoint, self._decoder = envelope.url, _REQUEST_DECODERS[envelope.url]
        elif envelope.url != self.endpoint:
            return LineError(
                line=line,
                code="invalid_url",
                message=f"The url {envelope.url!r} does not match the batch endpoint {self.endpoint!r}.",
                param="url",
            )
        if (error := self._claim(line, envelope.custom_id)) is not None:
            return error
        try:
            body = decoder.decode(envelope.body)
        except (msgspec.DecodeError, RecursionError) as exc:
            return _decode_error(line, exc, "body")
        if (error := self._check_body(line, body)) is not None:
            return error
        return _Request(custom_id=envelope.custom_id, method="POST", url=envelope.url, body=body)

    def _claim(self, line: int, custom_id: str) -> LineError | None:
        first = self._custom_ids.setdefault(custom_id, line)
        if first == line:
            return None
        return LineError(
            line=line,
            code="duplicate_custom_id",
            message=f"The custom_id {custom_id!r} is already used on line {first}.",
            param="custom_id",
        )

    def _check_body(self, line: int, body: RequestBody) -> LineError | None:
        if self.model is None:
            self.model, self._model_line = body.model, line
        elif body.model != self.model and not (body.model in self.family and self.model in self.family):
            where = f"line {self._model_line}" if self._model_line is not None else "the batch"
            return LineError(
                line=line,
                code="mismatched_model",
                message=f"The model {body.model!r} differs from {self.model!r} used by {where}; "
                "a batch uses one model.",
                param="body.model",
            )
        if not isinstance(body, EmbeddingRequest | PoolingBody) and body.stream:
            return LineError(
                line=line,
                code="streaming_unsupported",
                message="Streaming is not supported in batches; remove 'stream' or set it to false.",
                param="body.stream",
            )
        if (problem := request_problem(body)) is not None:
            field, detail = problem
            return LineError(
                line=line, code="invalid_request", message=f"Invalid 'body.{field}': {detail}", param=f"body.{field}"
            )
        return None


MAX_NESTING = 64
"""Deepest nesting of a free-form value (tools, a JSON schema, template variables): code that walks them recursively
(a chat template's ``tojson``, a grammar compiler) must never meet Python's recursion limit."""
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")
"""A token id as OpenAI's ``logit_bias`` keys write it: ASCII digits, no sign, no leading zero (``str.isdigit``
also accepts ``"²"``, which ``int()`` refuses)."""


def request_problem(body: RequestBody) -> tuple[str, str] | None:
    """What makes a body invalid beyond its fields' types, as ``(field, problem)``: the same checks for a batch line
    and an online request. A body without a problem hands the server nothing it could raise on."""
    if isinstance(body, ResponseRequest):  # checked as the chat request it runs as, in its own terms
        try:
            translation = translate(body)
        except ResponseInputProblem as exc:
            return exc.field, exc.detail
        if (found := request_problem(translation.chat)) is not None:
            return translation.field(found[0]), found[1]
        return None
    if isinstance(body, PoolingBody):
        if isinstance(body, ClassificationRequest | PoolingRequest) and (problem := _prompt_problem(body.input)):
            return "input", problem
        return pooling_problem(body)
    if isinstance(body, EmbeddingRequest):
        problem = _prompt_problem(body.input)
        return None if problem is None else ("input", problem)
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        return "top_logprobs", "it requires 'logprobs' to be true."
    if isinstance(body, ChatCompletionRequest) and (part := _image_not_from_the_user(body)) is not None:
        return part, "an image goes in a user message."
    if body.stream_options is not None and not body.stream:
        return "stream_options", "it is only allowed when 'stream' is true."
    if body.logit_bias and not all(_TOKEN_ID.fullmatch(key) and int(key) <= INT32_MAX for key in body.logit_bias):
        return "logit_bias", f"its keys must be token ids: integers from 0 to {INT32_MAX} written in plain digits."
    if isinstance(body, CompletionRequest) and (problem := _prompt_problem(body.prompt)) is not None:
        return "prompt", problem
    if (scoring := _scoring_problem(body)) is not None:
        return scoring
    if (structure := _structure_problem(body)) is not None:
        return structure
    for name, value in _free_form(body):
        if _too_deep(value):
            return name, f"it is nested more than {MAX_NESTING} levels deep."
    return None


def _image_not_from_the_user(body: ChatCompletionRequest) -> str | None:
    """The first image part of a message that is not the user's (OpenAI's API takes them in user messages only)."""
    for m, message in enumerate(body.messages):
        if message.role != "user" and isinstance(message.content, list):
            for p, part in enumerate(message.content):
                if isinstance(part, ImageContentPart | FileContentPart):
                    return f"messages[{m}].content[{p}]"
    return None


def _scoring_problem(body: ChatCompletionRequest | CompletionRequest) -> tuple[str, str] | None:
    """Prompt logprobs come whole with the final result (as vLLM's): not streamed; ``max_tokens`` 0 only echoes."""
    echo = isinstance(body, CompletionRequest) and bool(body.echo)
    if isinstance(body, CompletionRequest) and body.max_tokens == 0 and not echo:
        return "max_tokens", "0 is allowed only with 'echo' (the prompt scored, nothing generated)."
    if body.stream and body.prompt_logprobs is not None:
        return "prompt_logprobs", "it is not available when 'stream' is true."
    if body.stream and echo:
        return "echo", "it is not available when 'stream' is true."
    return None


def _structure_problem(body: ChatCompletionRequest | CompletionRequest) -> tuple[str, str] | None:
    """What makes the output constraints of ``body`` (its format, its tools) contradictory or incomplete."""
    constrained = []
    if (response_format := body.response_format) is not None and response_format.type != "text":
        if response_format.type == "json_schema" and response_format.json_schema is None:
            return "response_format.json_schema", "it is required when 'type' is 'json_schema'."
        constrained.append("response_format")
    if body.structured_outputs is not None:
        names = body.structured_outputs.constraints()
        if len(names) != 1:
            listed = ", ".join(names) if names else "none"
            return "structured_outputs", f"it must set exactly one of {', '.join(CONSTRAINTS)} (it sets {listed})."
        constrained.append("structured_outputs")
    if isinstance(body, ChatCompletionRequest) and body.tool_choice not in (None, "none", "auto"):
        names = [tool.function.name for tool in body.tools or ()]
        if not names:
            return "tool_choice", "it requires 'tools'."
        if isinstance(body.tool_choice, NamedToolChoice) and body.tool_choice.function.name not in names:
            return "tool_choice", f"the function {body.tool_choice.function.name!r} is not among the tools."
        constrained.append("tool_choice")
    if len(constrained) > 1:
        return constrained[1], f"it cannot be combined with '{constrained[0]}': a request follows one constraint."
    return None


def _free_form(body: ChatCompletionRequest | CompletionRequest) -> Iterator[tuple[str, object]]:
    """The values of ``body`` that no type bounds, by field name (inside its typed parts too: a tool's
    parameters, a format's schema)."""
    fields: list[tuple[str, object]] = [(name, getattr(body, name)) for name in body.__struct_fields__]
    while fields:
        name, value = fields.pop()
        if isinstance(value, msgspec.Struct):
            fields += ((f"{name}.{inner}", getattr(value, inner)) for inner in value.__struct_fields__)
        elif isinstance(value, list) and value and isinstance(value[0], msgspec.Struct):  # tools
            fields += ((f"{name}[{index}]", item) for index, item in enumerate(value))
        elif isinstance(value, dict | list) and name not in ("prompt", "messages", "stop", "stop_token_ids"):
            yield name, value
    if isinstance(body, ChatCompletionRequest):
        for index, message in enumerate(body.messages):
            if message.tool_calls is not None:
                yield f"messages[{index}].tool_calls", message.tool_calls


def _too_deep(value: object) -> bool:
    """Whether ``value`` nests lists and dicts deeper than ``MAX_NESTING`` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > MAX_NESTING:
                    return True
                stack.append((child, depth + 1))
    return False


def _prompt_problem(prompt: Prompt) -> str | None:
    """Why a prompt is not text, a list of texts, a list of token ids or a list of token-id lists (else None)."""
    if isinstance(prompt, str):
        return None
    if not prompt:
        return "the list must not be empty."
    kind = type(prompt[0])
    if not all(type(item) is kind for item in prompt):
        return "a list must hold only texts, only token ids, or only lists of token ids."
    if kind is int:
        return _token_problem(prompt)  # type: ignore[arg-type]
    if kind is list:
        for item in prompt:
            problem = _token_problem(item) if item else "a list of token ids must not be empty."  # type: ignore[arg-type]
            if problem is not None:
                return problem
    return None


def _token_problem(tokens: list[int]) -> str | None:
    if min(tokens) < 0:
        return "token ids must be non-negative."
    return f"token ids must be at most {INT32_MAX}." if max(tokens) > INT32_MAX else None


# --- public API ---------------------------------------------------------------------------------------------------


def iter_input_lines(
    source: Source,
    *,
    endpoint: str | None = None,
    model: str | None = None,
    limits: ValidationLimits = DEFAULT_LIMITS,
    family: Container[str] = (),
) -> Iterator[BatchInputLine | LineError]:
    """Yield each request of a JSONL input file, typed, or the error found on its line.

    ``source`` is a path or a binary file object, read in chunks. ``endpoint`` is the batch's endpoint: every line's
    ``url`` must match it (without it, the first valid line's url sets it). ``model``, when given, is the model
    every line must use (without it, the first valid line's model sets it), or any name of ``family`` if it is one
    (a base model and its LoRA adapters). Blank lines are skipped. File-level
    errors (``empty_file``, ``file_too_large``, ``too_many_requests``) come last and end the iteration.
    """
    validator = _RequestValidator(endpoint, model, family)
    for scanned in _LineScanner(limits).scan(source):
        for result in validator.validate(scanned):
            if isinstance(result, LineError):
                yield result
            else:
                yield BatchInputLine(custom_id=result.custom_id, method="POST", url=result.url, body=result.body)


def validate_input_file(
    source: Source,
    *,
    endpoint: str | None = None,
    model: str | None = None,
    limits: ValidationLimits = DEFAULT_LIMITS,
    max_errors: int = 100,
    family: Container[str] = (),
) -> ValidationReport:
    """Validate a whole input file without keeping its requests; see :func:`iter_input_lines`."""
    validator = _RequestValidator(endpoint, model, family)
    scanner = _LineScanner(limits)
    errors: list[LineError] = []
    error_count = 0
    for scanned in scanner.scan(source):
        for error in validator.validate(scanned, requests=False):
            assert isinstance(error, LineError)
            error_count += 1
            if len(errors) < max_errors:
                errors.append(error)
    return ValidationReport(
        request_count=scanner.requests,
        error_count=error_count,
        errors=errors,
        model=validator.model,
        endpoint=validator.endpoint,
    )


class _Work(msgspec.Struct, gc=False):
    """Matches any JSON object, keeping only its raw ``body``; the other fields are skipped (but still parsed)."""

    body: msgspec.Raw = msgspec.Raw(b"null")


class _WorkBody(msgspec.Struct, gc=False):
    """What a body's work depends on, of any type (the line is not validated yet)."""

    prompt: Any = None
    input: Any = None
    n: Any = 1


_WORK = msgspec.json.Decoder(_Work)
_WORK_BODY = msgspec.json.Decoder(_WorkBody)


def _line_sequences(body: msgspec.Raw) -> int:
    try:
        work = _WORK_BODY.decode(body)
    except msgspec.DecodeError:  # not an object: the batch's validation will say so
        return 1
    return count_sequences(work.input if work.prompt is None else work.prompt, work.n)


class UploadChecker:
    """The cheap upload-time check, fed chunk by chunk: UTF-8, one JSON object per non-blank line, size limits.

    ``feed`` and ``finish`` return the first error found (and keep returning it), so an upload can stop early. On
    the way it counts the file's requests (non-blank lines) and the sequences they ask for (``count_sequences``), so
    a server can admit a batch by its work before validating it.
    """

    def __init__(self, limits: ValidationLimits = DEFAULT_LIMITS) -> None:
        self._scanner = _LineScanner(limits)
        self.error: LineError | None = None
        self.sequences = 0

    @property
    def requests(self) -> int:
        return self._scanner.requests

    def feed(self, chunk: bytes) -> LineError | None:
        if self.error is None:
            self._check(self._scanner.feed(chunk))
        return self.error

    def finish(self) -> LineError | None:
        if self.error is None:
            self._check(self._scanner.finish())
        return self.error

    def _check(self, scanned: _Lines) -> None:
        for number, line in zip(*scanned, strict=True):
            if isinstance(line, LineError):
                self.error = line
                return
            try:
                body = _WORK.decode(line).body
            except (msgspec.DecodeError, RecursionError) as exc:
                self.error = _decode_error(number, exc, "")
                return
            self.sequences += _line_sequences(body)


def check_upload(source: Source, limits: ValidationLimits = DEFAULT_LIMITS) -> LineError | None:
    """Run :class:`UploadChecker` over a whole file; the first error, or ``None``."""
    checker = UploadChecker(limits)
    for chunk in _read_chunks(source):
        if checker.feed(chunk) is not None:
            return checker.error
    return checker.finish()
