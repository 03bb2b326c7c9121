"""The API docs pages and the console as served (no browser): same-origin assets only, the OpenAPI document's
upload form, security scheme and media types, open pages beside a keyed API, and the engine's token counters."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import httpx
import pytest
from server_helpers import LiveServer, chat_line

PAGES = ["/", "/schema", "/schema/redoc", "/schema/swagger"]
"""The console and the three docs viewers: every HTML page a person opens."""


class _References(HTMLParser):
    """Every URL a page makes the browser load: scripts, styles, icons, images, frames."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = {"script": "src", "link": "href", "img": "src", "iframe": "src", "source": "src", "embed": "src"}
        url = dict(attrs).get(names.get(tag, ""))
        if url:
            self.urls.append(url)


def _same_origin(url: str, base_url: str) -> bool:
    if url.startswith("data:"):
        return True
    absolute = urlsplit(urljoin(base_url + "/", url))
    return (absolute.scheme, absolute.netloc) == tuple(urlsplit(base_url)[:2])


@pytest.mark.parametrize("path", PAGES)
def test_pages_load_everything_from_this_server(live_server: LiveServer, path: str) -> None:
    page = live_server.http.get(path)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    parser = _References()
    parser.feed(page.text)
    assert parser.urls, "a page with no script or style of its own renders nothing"
    outside = [url for url in parser.urls if not _same_origin(url, live_server.base_url)]
    assert not outside, f"{path} loads from other hosts: {outside}"
    for url in parser.urls:
        if url.startswith("data:"):
            continue
        asset = live_server.http.get(urljoin(live_server.base_url + path, url))
        assert asset.status_code == 200, url
        assert asset.headers["content-type"].split(";")[0] in ("text/javascript", "application/javascript", "text/css")
        if asset.headers["content-type"].startswith("text/css"):  # a stylesheet may pull fonts or images in turn
            assert not re.findall(r"url\(\s*['\"]?(?:https?:)?//", asset.text), url


def test_the_console_page_forbids_other_hosts(live_server: LiveServer) -> None:
    policy = live_server.http.get("/").headers["content-security-policy"]
    assert "default-src 'self'" in policy and "http" not in policy


def test_openapi_document_declares_the_upload_form_bearer_auth_and_jsonl(live_server: LiveServer) -> None:
    document = live_server.http.get("/schema/openapi.json").json()
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": document["components"]["securitySchemes"]["bearer"]["description"],
    }
    operations = [
        (path, method, operation)
        for path, item in document["paths"].items()
        for method, operation in item.items()
        if path.startswith("/v1/")
    ]
    assert operations and all(operation["security"] == [{"bearer": []}] for _, _, operation in operations)
    assert "security" not in document["paths"]["/health"]["get"]

    form = document["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["required"] == ["file", "purpose"]
    assert form["properties"]["file"] == {"type": "string", "format": "binary", "description": "The JSONL input file."}
    assert form["properties"]["purpose"]["enum"] == ["batch", "vision", "user_data"]  # images: docs/api.md, Images
    assert {"expires_after[anchor]", "expires_after[seconds]"} <= set(form["properties"])

    content = document["paths"]["/v1/files/{file_id}/content"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["application/jsonl"]
    health = document["paths"]["/health"]["get"]["responses"]
    assert health["503"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/HealthStatus"}


def test_content_is_served_as_documented(live_server: LiveServer) -> None:
    file = live_server.upload([chat_line("a")])
    response = live_server.http.get(f"/v1/files/{file['id']}/content")
    assert response.headers["content-type"] == "application/jsonl"


def test_pages_and_assets_are_open_while_the_api_needs_a_key(keyed_server: LiveServer) -> None:
    with httpx.Client(base_url=keyed_server.base_url) as anonymous:
        for path in [*PAGES, "/console/console.js", "/console/console.css", "/schema/assets/swagger-ui-bundle.js"]:
            assert anonymous.get(path).status_code == 200, path
        for path in ["/v1/batches", "/v1/files", "/v1/pool/status"]:
            assert anonymous.get(path).status_code == 401, path
        # Only the named files are served: no other file beside them, and no way out of the open prefixes.
        for path in ["/console/__init__.py", "/console/index.html", "/schema/assets/index.html"]:
            missing = anonymous.get(path)
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found", path
        assert anonymous.get("/console/%2e%2e/v1/batches").status_code == 401


def test_pool_status_counts_the_engine_tokens(live_server: LiveServer) -> None:
    before = live_server.http.get("/v1/pool/status").json()
    batch = live_server.run([chat_line(f"t{i}") for i in range(3)])
    after = live_server.http.get("/v1/pool/status").json()
    assert after["generated_tokens"] - before["generated_tokens"] >= batch["usage"]["output_tokens"] > 0
    assert after["prompt_tokens"] - before["prompt_tokens"] >= batch["usage"]["input_tokens"] > 0


def test_blank_expiry_fields_keep_the_file(live_server: LiveServer) -> None:
    """What a form, the docs page's included, sends for the expiry fields left empty."""
    blank = {"purpose": "batch", "expires_after[anchor]": "", "expires_after[seconds]": ""}
    response = live_server.http.post("/v1/files", data=blank, files={"file": ("a.jsonl", b"{}\n")})
    assert response.status_code == 200 and response.json()["expires_at"] is None
