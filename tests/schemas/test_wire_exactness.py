"""Every object we encode validates in strict mode against the official ``openai`` types, where one exists.

Each object is built twice: with every optional field populated, and with only the required fields (all optionals
``None``). Fields OpenAI always sends must be present in our JSON, as ``null`` when unset.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import openai.types as oai
import openai.types.chat as oai_chat
import pytest
from openai.pagination import SyncCursorPage, SyncPage
from openai.types import batch_create_params, completion_create_params, embedding_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params
from openai.types.shared import ErrorObject
from pydantic import BaseModel, TypeAdapter

from batchgen.schemas import (
    BatchError,
    BatchErrors,
    BatchList,
    BatchObject,
    BatchRequestCounts,
    BatchUsage,
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionTokensDetails,
    CompletionUsage,
    CreateBatchRequest,
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    ErrorDetail,
    ErrorResponse,
    ExpiresAfter,
    FileDeleted,
    FileList,
    FileObject,
    FunctionCallItem,
    InputTokensDetails,
    ModelList,
    ModelObject,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    PromptTokensDetails,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponseFormat,
    ResponseRequest,
    ResponseUsage,
    TextCompletion,
    TextContentPart,
    TokenLogprob,
    TopLogprob,
)
from batchgen.schemas.responses_api import ResponseInputTokensDetails

# --- our objects, full and minimal -----------------------------------------------------------------------------


def full_batch() -> BatchObject:
    return BatchObject(
        id="batch_1",
        endpoint="/v1/chat/completions",
        model="demo",
        errors=BatchErrors(data=[BatchError(code="invalid_request", message="bad", param="body.n", line=3)]),
        input_file_id="file-in",
        completion_window="24h",
        status="completed",
        output_file_id="file-out",
        error_file_id="file-err",
        created_at=1_700_000_000,
        in_progress_at=1_700_000_001,
        expires_at=1_700_086_400,
        finalizing_at=1_700_000_002,
        completed_at=1_700_000_003,
        failed_at=1_700_000_004,
        expired_at=1_700_000_005,
        cancelling_at=1_700_000_006,
        cancelled_at=1_700_000_007,
        request_counts=BatchRequestCounts(total=3, completed=2, failed=1),
        usage=BatchUsage(
            input_tokens=30,
            input_tokens_details=InputTokensDetails(cached_tokens=4),
            output_tokens=12,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
            total_tokens=42,
        ),
        metadata={"project": "eval"},
        max_decoding_length=64,
        max_context_length=2048,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
    )


def minimal_batch() -> BatchObject:
    return BatchObject(
        id="batch_2",
        endpoint="/v1/completions",
        input_file_id="file-in",
        completion_window="24h",
        status="validating",
        created_at=1_700_000_000,
    )


def full_file() -> FileObject:
    return FileObject(
        id="file-1",
        bytes=1024,
        created_at=1_700_000_000,
        filename="requests.jsonl",
        purpose="batch",
        status="uploaded",
        status_details="validated",
        expires_at=1_700_086_400,
        checksum="sha256:" + "0" * 64,
    )


def minimal_file() -> FileObject:
    return FileObject(id="file-2", bytes=0, created_at=1, filename="out.jsonl", purpose="batch_output")


def usage() -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=5,
        completion_tokens=3,
        total_tokens=8,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=2),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=0),
    )


def full_chat_completion() -> ChatCompletion:
    top = [TopLogprob(token="a", bytes=[97], logprob=-0.1), TopLogprob(token="b", bytes=None, logprob=-2.5)]
    logprobs = ChoiceLogprobs(
        content=[TokenLogprob(token="a", bytes=[97], logprob=-0.1, top_logprobs=top)],
        refusal=[TokenLogprob(token="no", bytes=[110, 111], logprob=-3.0, top_logprobs=[])],
    )
    return ChatCompletion(
        id="chatcmpl-1",
        created=1_700_000_000,
        model="demo",
        choices=[
            ChatCompletionChoice(
                index=0,
                message=ChatCompletionMessage(content="Hello", refusal="none"),
                logprobs=logprobs,
                finish_reason="stop",
            ),
            ChatCompletionChoice(index=1, message=ChatCompletionMessage(content="Hi"), finish_reason="length"),
        ],
        usage=usage(),
        system_fingerprint="fp_batchgen",
    )


def minimal_chat_completion() -> ChatCompletion:
    choice = ChatCompletionChoice(index=0, message=ChatCompletionMessage(), finish_reason="stop")
    usage = CompletionUsage(prompt_tokens=1, completion_tokens=0, total_tokens=1)
    return ChatCompletion(id="chatcmpl-2", created=1, model="demo", choices=[choice], usage=usage)


def full_text_completion() -> TextCompletion:
    logprobs = CompletionLogprobs(
        tokens=["a", "b"],
        token_logprobs=[-0.1, -0.2],
        top_logprobs=[{"a": -0.1, "c": -3.0}, {"b": -0.2}],
        text_offset=[0, 1],
    )
    return TextCompletion(
        id="cmpl-1",
        created=1_700_000_000,
        model="demo",
        choices=[CompletionChoice(index=0, text="ab", logprobs=logprobs, finish_reason="length")],
        usage=usage(),
        system_fingerprint="fp_batchgen",
    )


def minimal_text_completion() -> TextCompletion:
    usage = CompletionUsage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    choice = CompletionChoice(index=0, text="", finish_reason="stop")
    return TextCompletion(id="cmpl-2", created=1, model="demo", choices=[choice], usage=usage)


def embedding_list() -> EmbeddingList:
    return EmbeddingList(
        data=[Embedding(index=0, embedding=[0.25, -1.0, 3.5]), Embedding(index=1, embedding=[0.0, 1.0, 2.0])],
        model="demo",
        usage=EmbeddingUsage(prompt_tokens=4, total_tokens=4),
    )


def full_response() -> Response:
    """What a response that thought, wrote and called a tool looks like (as ``serving.responses`` builds it)."""
    return Response(
        id="resp_1",
        created_at=1_700_000_000,
        status="completed",
        completed_at=1_700_000_001,
        instructions="Be brief.",
        max_output_tokens=64,
        metadata={"k": "v"},
        model="demo",
        output=[
            ReasoningItem(id="rs_1", content=[ReasoningText(text="Hmm.")], status="completed"),
            OutputMessage(id="msg_1", status="completed", content=[OutputText(text="Let me look.")]),
            FunctionCallItem(
                id="fc_1", call_id="call_1", name="weather", arguments='{"city": "Oslo"}', status="completed"
            ),
        ],
        temperature=0.5,
        text={"format": {"type": "json_object"}},  # (a json_schema's "schema" the SDK dumps as "schema_")
        tool_choice={"type": "function", "name": "weather"},
        tools=[{"type": "function", "name": "weather", "parameters": {"type": "object"}, "strict": True}],
        top_p=1.0,
        usage=ResponseUsage(
            input_tokens=10,
            input_tokens_details=ResponseInputTokensDetails(cached_tokens=4),
            output_tokens=5,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=2),
            total_tokens=15,
        ),
    )


def full_model() -> ModelObject:
    return ModelObject(id="demo", created=1_700_000_000, owned_by="batchgen", max_context_length=2048)


# --- strict validation against openai ------------------------------------------------------------------------------


def materialize(value: Any) -> Any:
    """Consume pydantic's lazy ``Iterable`` validators so that every nested item is validated too."""
    if isinstance(value, dict):
        return {key: materialize(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [materialize(item) for item in value]
    if isinstance(value, Iterator):
        return [materialize(item) for item in value]
    return value


RESPONSE_CASES: list[tuple[str, Callable[[], msgspec.Struct], type[BaseModel]]] = [
    ("batch full", full_batch, oai.Batch),
    ("batch minimal", minimal_batch, oai.Batch),
    ("batch list", lambda: BatchList(data=[full_batch(), minimal_batch()], first_id="batch_1", last_id="batch_2"),
     SyncCursorPage[oai.Batch]),
    ("batch list empty", lambda: BatchList(data=[]), SyncCursorPage[oai.Batch]),
    ("batch error", lambda: BatchError(code="invalid_json_line", message="bad", param=None, line=1), oai.BatchError),
    ("batch error minimal", BatchError, oai.BatchError),
    ("file full", full_file, oai.FileObject),
    ("file minimal", minimal_file, oai.FileObject),
    ("file list", lambda: FileList(data=[full_file(), minimal_file()], first_id="file-1", last_id="file-2",
                                   has_more=True), SyncCursorPage[oai.FileObject]),
    ("file deleted", lambda: FileDeleted(id="file-1", deleted=True), oai.FileDeleted),
    ("model", full_model, oai.Model),
    ("model list", lambda: ModelList(data=[full_model()]), SyncPage[oai.Model]),
    ("chat completion full", full_chat_completion, oai_chat.ChatCompletion),
    ("chat completion minimal", minimal_chat_completion, oai_chat.ChatCompletion),
    ("text completion full", full_text_completion, oai.Completion),
    ("text completion minimal", minimal_text_completion, oai.Completion),
    ("embeddings", embedding_list, oai.CreateEmbeddingResponse),
    ("response full", full_response, oai.responses.Response),
    ("response queued", lambda: Response(id="resp_2", created_at=1, status="queued", background=True, model="demo"),
     oai.responses.Response),
]  # fmt: skip


@pytest.mark.parametrize(("name", "build", "official"), RESPONSE_CASES, ids=[case[0] for case in RESPONSE_CASES])
def test_encoded_objects_validate_strictly(name: str, build: Callable[[], msgspec.Struct], official: Any) -> None:
    ours = build()
    parsed = official.model_validate_json(msgspec.json.encode(ours), strict=True)
    # Every value survives: what the SDK read (our extensions kept as extra fields) is exactly what we sent.
    assert parsed.model_dump(mode="json", exclude_unset=True) == msgspec.to_builtins(ours)


def test_error_envelope_validates_strictly() -> None:
    full = ErrorResponse(
        error=ErrorDetail(message="No such batch", type="invalid_request_error", param="batch_id", code="not_found")
    )
    minimal = ErrorResponse(error=ErrorDetail(message="Server error", type="server_error"))
    for ours in (full, minimal):
        encoded = msgspec.json.decode(msgspec.json.encode(ours))
        assert set(encoded) == {"error"}
        assert set(encoded["error"]) == {"message", "type", "param", "code"}
        parsed = ErrorObject.model_validate(encoded["error"], strict=True)
        assert (parsed.message, parsed.type, parsed.param, parsed.code) == (
            ours.error.message,
            ours.error.type,
            ours.error.param,
            ours.error.code,
        )


def test_batch_errors_validate_strictly() -> None:
    errors = BatchErrors(data=[BatchError(code="empty_file", message="The file contains no requests.")])
    parsed = oai.batch.Errors.model_validate_json(msgspec.json.encode(errors), strict=True)
    assert parsed.object == "list"
    assert parsed.data is not None and parsed.data[0].code == "empty_file" and parsed.data[0].line is None


# --- nullable fields are sent as null, never dropped -----------------------------------------------------------------

ALWAYS_SENT: list[tuple[Callable[[], msgspec.Struct], type[BaseModel], set[str]]] = [
    (minimal_batch, oai.Batch, set()),
    (minimal_file, oai.FileObject, set()),
    (lambda: FileDeleted(id="file-1", deleted=False), oai.FileDeleted, set()),
    (full_model, oai.Model, {"shutdown_date"}),
    # Not produced by a model without tools, audio, moderation or service tiers.
    (minimal_chat_completion, oai_chat.ChatCompletion, {"metadata", "moderation", "service_tier"}),
    (minimal_text_completion, oai.Completion, set()),
]


@pytest.mark.parametrize(("build", "official", "not_ours"), ALWAYS_SENT)
def test_every_official_field_is_sent(
    build: Callable[[], msgspec.Struct], official: type[BaseModel], not_ours: set[str]
) -> None:
    encoded = msgspec.json.decode(msgspec.json.encode(build()))
    assert set(official.model_fields) - not_ours <= set(encoded)


def test_minimal_batch_sends_every_timestamp_as_null() -> None:
    encoded = msgspec.json.decode(msgspec.json.encode(minimal_batch()))
    timestamps = ["in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at"]
    timestamps += ["cancelling_at", "cancelled_at"]
    assert all(name in encoded and encoded[name] is None for name in timestamps)
    extensions = ["max_decoding_length", "max_context_length", "temperature", "top_p", "top_k"]
    assert all(name in encoded and encoded[name] is None for name in extensions)
    assert encoded["errors"] is None and encoded["model"] is None and encoded["metadata"] is None
    assert encoded["request_counts"] == {"total": 0, "completed": 0, "failed": 0}


def test_chat_message_sends_content_and_refusal_as_null() -> None:
    choice = msgspec.json.decode(msgspec.json.encode(minimal_chat_completion()))["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": None, "refusal": None}
    assert choice["logprobs"] is None


# --- request bodies and batch creation against the SDK's parameter types -------------------------------------------


def full_chat_request() -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="demo",
        messages=[
            ChatMessage(role="developer", content="Answer in French."),
            ChatMessage(role="system", content="Be brief."),
            ChatMessage(role="user", content=[TextContentPart(text="Hello "), TextContentPart(text="there")], name="u"),
            ChatMessage(role="assistant", content="Bonjour"),
        ],
        max_tokens=16,
        max_completion_tokens=16,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=7,
        stop=["\n", "###"],
        n=2,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        stream=False,
        user="me",
        logprobs=True,
        top_logprobs=3,
        response_format=ResponseFormat(type="json_object"),
    )


# A prompt of token-id lists is left out: the SDK's lazy union takes its first Iterable branch (Iterable[int]) for it.
REQUEST_CASES: list[tuple[str, msgspec.Struct, Any]] = [
    ("chat full", full_chat_request(), chat_create_params.CompletionCreateParamsNonStreaming),
    ("chat minimal", ChatCompletionRequest(model="demo", messages=[ChatMessage(role="user", content="Hi")]),
     chat_create_params.CompletionCreateParamsNonStreaming),
    ("completion text", CompletionRequest(model="demo", prompt="Once", max_tokens=8, stop="\n", logprobs=2,
                                          echo=True, seed=1, temperature=0.0),
     completion_create_params.CompletionCreateParamsBase),
    ("completion tokens", CompletionRequest(model="demo", prompt=[1, 2, 3]),
     completion_create_params.CompletionCreateParamsBase),
    ("completion texts", CompletionRequest(model="demo", prompt=["a", "b"]),
     completion_create_params.CompletionCreateParamsBase),
    ("embedding full", EmbeddingRequest(model="demo", input=["a", "b"], encoding_format="base64", dimensions=8,
                                        user="me"), embedding_create_params.EmbeddingCreateParams),
    ("embedding minimal", EmbeddingRequest(model="demo", input="a"), embedding_create_params.EmbeddingCreateParams),
    ("create batch", CreateBatchRequest(input_file_id="file-1", metadata={"k": "v"}, max_decoding_length=32,
                                        temperature=1.0, top_p=0.5, top_k=5,
                                        output_expires_after=ExpiresAfter(anchor="created_at", seconds=7200)),
     batch_create_params.BatchCreateParams),
    ("response", msgspec.convert({
        "model": "demo", "instructions": "Be brief.", "max_output_tokens": 8, "temperature": 0.5, "top_p": 0.9,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                  {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c", "output": "1"}],
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "f"}, "background": True, "metadata": {"k": "v"}},
        ResponseRequest), response_create_params.ResponseCreateParamsNonStreaming),
]  # fmt: skip


@pytest.mark.parametrize(("name", "ours", "official"), REQUEST_CASES, ids=[case[0] for case in REQUEST_CASES])
def test_request_bodies_validate_strictly(name: str, ours: msgspec.Struct, official: Any) -> None:
    sent = msgspec.json.decode(msgspec.json.encode(ours))
    # The SDK types lists as lazy ``Iterable``s: validate the decoded JSON (from JSON input pydantic takes a string
    # for an Iterable), keep the adapter alive while the iterators run, and consume them all.
    adapter = TypeAdapter(official)
    parsed = materialize(adapter.validate_python(sent, strict=True))
    # Every field the SDK knows keeps its value; the rest are batchgen extensions (top_k, ignore_eos...).
    assert {key: sent[key] for key in parsed} == parsed


def test_request_bodies_round_trip_through_the_sdk_shape() -> None:
    sent = msgspec.json.decode(msgspec.json.encode(full_chat_request()))
    assert msgspec.convert(sent, ChatCompletionRequest) == full_chat_request()
    assert set(sent) >= {"top_k", "ignore_eos"}  # the extensions travel next to the OpenAI fields


@pytest.mark.parametrize(
    ("ours", "official"),
    [
        (ChatCompletionRequest, chat_create_params.CompletionCreateParamsStreaming),
        (CompletionRequest, completion_create_params.CompletionCreateParamsStreaming),
        (EmbeddingRequest, embedding_create_params.EmbeddingCreateParams),
        (ResponseRequest, response_create_params.ResponseCreateParamsStreaming),
    ],
)
def test_every_field_the_sdk_sends_is_declared(ours: type[msgspec.Struct], official: Any) -> None:
    """Each is honoured, a no-op or refused by name (unsupported_parameter); an undeclared one would be refused as
    unknown, so a new SDK field fails here first."""
    assert set(typing.get_type_hints(official)) <= set(ours.__struct_fields__)
