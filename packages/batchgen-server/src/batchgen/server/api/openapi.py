"""The OpenAPI document and its viewers under ``/schema``, served with their scripts from this server (the
``openapi-ui-bundles`` package ships them) so the pages work without internet; Litestar's defaults load them from
CDNs.

``/schema`` and ``/schema/redoc``: Redoc (to read); ``/schema/swagger``: Swagger UI (to try the API, Authorize with a
key); ``/schema/openapi.json`` and ``/schema/openapi.yaml``: the document.
"""

from __future__ import annotations

from litestar import Router
from litestar.datastructures import ResponseHeader
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import (
    JsonRenderPlugin,
    RedocRenderPlugin,
    SwaggerRenderPlugin,
    YamlRenderPlugin,
)
from litestar.openapi.spec import Components, SecurityRequirement, SecurityScheme
from openapi_ui_bundles import redoc, swagger_ui

from ..static_files import SAME_ORIGIN_POLICY, static_files

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
    return OpenAPIConfig(
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
