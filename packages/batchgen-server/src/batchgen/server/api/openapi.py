"""The OpenAPI document and its viewers under ``/schema``, served with their scripts from this server (the
``openapi-ui-bundles`` package ships them) so the pages work without internet; Litestar's defaults load them from
CDNs.

``/schema`` and ``/schema/redoc``: Redoc; ``/schema/swagger``: Swagger UI (try the API, Authorize with a key);
``/schema/rapidoc``: RapiDoc; ``/schema/openapi.json`` and ``/schema/openapi.yaml``: the document.
"""

from __future__ import annotations

from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import (
    JsonRenderPlugin,
    RapidocRenderPlugin,
    RedocRenderPlugin,
    SwaggerRenderPlugin,
    YamlRenderPlugin,
)
from litestar.openapi.spec import Components, SecurityRequirement, SecurityScheme
from openapi_ui_bundles import rapidoc, redoc, swagger_ui

from ..static_files import static_files

ASSETS_PATH = "/schema/assets"
ASSETS = {
    "swagger-ui-bundle.js": swagger_ui.static_path / "swagger-ui-bundle.js",
    "swagger-ui-standalone-preset.js": swagger_ui.static_path / "swagger-ui-standalone-preset.js",
    "swagger-ui.css": swagger_ui.static_path / "swagger-ui.css",
    "redoc.standalone.js": redoc.static_path / "redoc.standalone.js",
    "rapidoc-min.js": rapidoc.static_path / "rapidoc-min.js",
}
docs_assets = static_files(ASSETS_PATH, ASSETS, name="docs-assets")

BEARER_AUTH: list[SecurityRequirement] = [{"bearer": []}]
"""The security requirement of every ``/v1`` operation (Swagger UI's Authorize button)."""

_NO_FAVICON = '<link rel="icon" href="data:,">'
"""Litestar's default favicon is fetched from a CDN; an empty one asks for nothing."""


def _asset(name: str) -> str:
    return f"{ASSETS_PATH}/{name}"


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
            RapidocRenderPlugin(js_url=_asset("rapidoc-min.js"), favicon=_NO_FAVICON),
            JsonRenderPlugin(),
            YamlRenderPlugin(),
        ],
    )
