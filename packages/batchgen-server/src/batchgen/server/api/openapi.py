"""The OpenAPI document and its viewers under ``/schema``, served with their scripts from this server (the
``openapi-ui-bundles`` package ships them) so the pages work without internet; Litestar's defaults load them from
CDNs.

``/schema`` and ``/schema/redoc``: Redoc (to read); ``/schema/swagger``: Swagger UI (to try the API, Authorize with a
key); ``/schema/openapi.json`` and ``/schema/openapi.yaml``: the document.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from typing import Any

import msgspec
from litestar import Router
from litestar.datastructures import ResponseHeader
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import (
    JsonRenderPlugin,
    RedocRenderPlugin,
    SwaggerRenderPlugin,
    YamlRenderPlugin,
)
from litestar.openapi.spec import Components, OpenAPI, SecurityRequirement, SecurityScheme
from openapi_ui_bundles import redoc, swagger_ui

from batchgen.schemas import (
    ENDPOINTS,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    CreateBatchRequest,
    EmbeddingRequest,
    ErrorResponse,
    Response,
    ResponseRequest,
    TextCompletion,
    TextCompletionChunk,
)
from batchgen.schemas.pooling import ClassificationRequest, PoolingRequest, RerankRequest, ScoreRequest
from batchgen.schemas.requests import NO_OP_VALUES, ChoiceCount, Prompt, TokenId, Unsupported
from batchgen.schemas.responses_api import ResponseEvent

from ..security.limits import MAX_METADATA_KEY_LENGTH, MAX_METADATA_KEYS, MAX_METADATA_VALUE_LENGTH
from ..static_files import SAME_ORIGIN_POLICY, static_files
from .batches import MAX_TOP_K
from .idempotency import IDEMPOTENCY_KEY, MAX_KEY_LENGTH

DOCS_PATH = "/schema"
ASSETS = {
    "swagger-ui-bundle.js": swagger_ui.static_path / "swagger-ui-bundle.js",
    "swagger-ui-standalone-preset.js": swagger_ui.static_path / "swagger-ui-standalone-preset.js",
    "swagger-ui.css": swagger_ui.static_path / "swagger-ui.css",
    "redoc.standalone.js": redoc.static_path / "redoc.standalone.js",
}
DOCS_POLICY = (
    f"{SAME_ORIGIN_POLICY}; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; worker-src blob:"
)
"""The viewers start from inline scripts and styles, and Redoc searches in a blob: worker; nothing comes from another
host, not even the Redocly logo that Redoc's sidebar would fetch from a CDN."""

BEARER_AUTH: list[SecurityRequirement] = [{"bearer": []}]
"""The security requirement of every ``/v1`` operation (Swagger UI's Authorize button)."""

_NO_FAVICON = '<link rel="icon" href="data:,">'
"""Litestar's default favicon is fetched from a CDN; an empty one asks for nothing."""


def _asset(name: str) -> str:
    return f"{DOCS_PATH}/assets/{name}"


def openapi_config() -> OpenAPIConfig:
    bearer = SecurityScheme(
        type="http",
        scheme="bearer",
        description="One of the server's --api-key values. Without keys configured, any value (or none) works.",
    )
    return _Config(
        title="batchgen",
        version="0.1.0",
        description="OpenAI-compatible batch inference: Files and Batches API over batchgen's own engine.",
        components=Components(security_schemes={"bearer": bearer}),
        openapi_router=Router(
            DOCS_PATH,
            route_handlers=[static_files("/assets", ASSETS, name="docs-assets")],
            include_in_schema=False,
            response_headers=[ResponseHeader(name="Content-Security-Policy", value=DOCS_POLICY)],
        ),
        render_plugins=[
            RedocRenderPlugin(
                path=["/", "/redoc"], js_url=_asset("redoc.standalone.js"), google_fonts=False, favicon=_NO_FAVICON
            ),
            SwaggerRenderPlugin(
                js_url=_asset("swagger-ui-bundle.js"),
                css_url=_asset("swagger-ui.css"),
                standalone_preset_js_url=_asset("swagger-ui-standalone-preset.js"),
                favicon=_NO_FAVICON,
            ),
            JsonRenderPlugin(),
            YamlRenderPlugin(),
        ],
    )


REF = "#/components/schemas/{name}"
REQUEST_BODIES = (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ResponseRequest,
    CreateBatchRequest,
    ScoreRequest,
    RerankRequest,
    ClassificationRequest,
    PoolingRequest,
)
RESPONSE_EVENTS = typing.Union[tuple(ResponseEvent.__subclasses__())]  # type: ignore[valid-type]  # noqa: UP007
STREAMS: dict[str, tuple[type, Any]] = {
    "/v1/chat/completions": (ChatCompletion, ChatCompletionChunk),
    "/v1/completions": (TextCompletion, TextCompletionChunk),
    "/v1/responses": (Response, RESPONSE_EVENTS),
}
"""The endpoints that answer ``stream: true`` with server-sent events: their whole answer, and what each event
carries (their handlers return either, which Litestar cannot describe)."""

_TEXT = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "items": msgspec.json.schema(TokenId), "minItems": 1}
PROMPT = {
    "description": "A text, a list of texts, a list of token ids or a list of token-id lists (none empty).",
    "oneOf": [
        _TEXT,
        {"type": "array", "items": _TEXT, "minItems": 1},
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
    ],
}
"""What ``request_problem`` accepts of msgspec's ``str | list[str | int | list[int]]``: one kind of list, none empty
(a text that tokenizes to nothing is refused too)."""

NOT_NULL = {"not": {"type": "null"}}
TOKEN_ID_KEY = "^(0|[1-9][0-9]{0,9})$"
"""A ``logit_bias`` key: a token id in plain digits (the model's vocabulary bounds it, far below 10 digits)."""
COMPLETION_WINDOW = "^(2[4-9]|[3-9][0-9]|[12][0-9]{2}|3[0-2][0-9]|33[0-6])h$|^([1-9]|1[0-4])d$"
"""``completion_window_hours``: whole hours from 24 to 336, or days from 1 to 14."""


@dataclass
class _Config(OpenAPIConfig):
    """Litestar's config, whose document is a ``_Document``."""

    def to_openapi_schema(self) -> OpenAPI:
        generated = super().to_openapi_schema()
        return _Document(**{field.name: getattr(generated, field.name) for field in fields(generated)})


@dataclass
class _Document(OpenAPI):
    """The document Litestar generates (once, at the first request for it), ``_completed`` as it becomes the dict
    every page and format renders."""

    def to_schema(self) -> dict[str, Any]:
        return _completed(super().to_schema())


def _completed(document: dict[str, Any]) -> dict[str, Any]:
    """Litestar's document, with what the server enforces that Litestar leaves out: msgspec's own schemas of the
    request bodies (Litestar drops their bounds inside ``X | None`` and their ``additionalProperties: false``), the
    checks the server makes beyond the types, the Idempotency-Key's length and the event streams."""
    schemas = document["components"]["schemas"]
    _, components = msgspec.json.schema_components(
        (*REQUEST_BODIES, *(chunk for _, chunk in STREAMS.values()), Response, ErrorResponse), ref_template=REF
    )
    schemas.update(components)
    for body in REQUEST_BODIES:
        properties = schemas[body.__name__]["properties"]
        for field in msgspec.structs.fields(body):
            if field.type == Prompt:
                properties[field.encode_name] = PROMPT
            elif field.type == Unsupported:
                properties[field.encode_name] |= _unsupported(field.name)
    _describe_checks(schemas)
    for path, item in document["paths"].items():
        for operation in item.values():
            for parameter in operation.get("parameters", []):
                if parameter["name"] == IDEMPOTENCY_KEY:
                    parameter["schema"] = {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH}
        if path in STREAMS:
            answer = item["post"]["responses"]["200"]
            whole, chunk = STREAMS[path]
            answer["content"]["application/json"] = {"schema": {"$ref": REF.format(name=whole.__name__)}}
            answer["content"]["text/event-stream"] = {
                "schema": _response_event() if chunk is RESPONSE_EVENTS else _event(chunk.__name__)
            }
    return document


def _describe_checks(schemas: dict[str, Any]) -> None:
    """What ``request_problem``, the chat template and ``_create_batch`` refuse beyond the types, where a schema
    keyword can say it."""
    chat, completion, batch = (
        schemas[body.__name__] for body in (ChatCompletionRequest, CompletionRequest, CreateBatchRequest)
    )
    for body in (chat, completion):
        body["allOf"] = [_implies("stream_options", NOT_NULL, "stream", True)]
        _not_null(body["properties"]["logit_bias"])["propertyNames"] = {"pattern": TOKEN_ID_KEY}
    chat["allOf"] += [
        _implies("top_logprobs", NOT_NULL, "logprobs", True),
        _implies("continue_final_message", {"const": True}, "add_generation_prompt", False),  # transformers' rule
    ]
    properties = batch["properties"]
    properties["endpoint"]["enum"] = list(ENDPOINTS)
    properties["completion_window"]["pattern"] = COMPLETION_WINDOW
    _not_null(properties["top_k"])["maximum"] = MAX_TOP_K
    _not_null(properties["metadata"]).update(
        maxProperties=MAX_METADATA_KEYS,
        propertyNames={"maxLength": MAX_METADATA_KEY_LENGTH},
        additionalProperties={"type": "string", "maxLength": MAX_METADATA_VALUE_LENGTH},
    )


def _implies(field: str, when: dict[str, Any], other: str, value: bool) -> dict[str, Any]:
    """A ``field`` that matches ``when`` requires ``other`` to be ``value``."""
    return {
        "if": {"properties": {field: when}, "required": [field]},
        "then": {"properties": {other: {"const": value}}, "required": [other]},
    }


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """The branch of msgspec's ``X | None`` schema that is not null."""
    return next(branch for branch in schema["anyOf"] if branch.get("type") != "null")


def _unsupported(name: str) -> dict[str, Any]:
    """What an unsupported field may be set to (``unsupported_parameter``): null, or a value that changes nothing, in
    each JSON spelling Python finds equal to it (``0 == False``, ``1 == True``)."""
    if name == "best_of":  # accepted when equal to n
        return {"anyOf": [{"type": "null"}, msgspec.json.schema(ChoiceCount), {"const": True}]}
    values: dict[bytes, Any] = {b"null": None}
    for value in NO_OP_VALUES.get(name, ()):
        spellings = [bool(value), int(value)] if value in (0, 1) else [value]
        values.update((msgspec.json.encode(spelling), spelling) for spelling in spellings)
    return {"enum": list(values.values())}


def _response_event() -> dict[str, Any]:
    """One server-sent event of a streamed response: its ``type`` as the event's name, the event as its data."""
    events = [{"$ref": REF.format(name=event.__name__)} for event in ResponseEvent.__subclasses__()]
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": events}}
    return {
        "type": "object",
        "required": ["event", "data"],
        "properties": {"event": {"type": "string"}, "data": json_data},
        "description": "With `stream: true`: `event: <type>` and `data: <event JSON>`, `response.created` first and "
        "`response.completed` (or `response.incomplete`) last.",
    }


def _event(chunk: str) -> dict[str, Any]:
    """One server-sent event (what the schema of a ``text/event-stream`` describes in OpenAPI 3.1): a chunk, an
    error envelope if the request fails midway, and ``[DONE]`` last."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [{"$ref": REF.format(name=chunk)}, {"$ref": REF.format(name="ErrorResponse")}]},
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
        "description": f"With `stream: true`: events `data: <{chunk} JSON>`, then `data: [DONE]`.",
    }
