"""The API docs pages in a real browser with every other host cut off: each renders the API from this server alone,
and Swagger UI uploads a file through the documented form, authorized with a key."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest
from server_helpers import TENANT_KEYS, LiveServer

if TYPE_CHECKING:
    from playwright.sync_api import Page, Route

expect = pytest.importorskip("playwright.sync_api").expect


def _cut_off_other_hosts(page: Page, base_url: str) -> list[str]:
    """Abort every request to another origin; the list fills with their URLs."""
    origin = urlsplit(base_url)[:2]
    outside: list[str] = []

    def handle(route: Route) -> None:
        url = route.request.url
        if urlsplit(url)[:2] == origin or url.startswith(("data:", "blob:")):
            route.continue_()
        else:
            outside.append(url)
            route.abort()

    page.route("**/*", handle)
    return outside


@pytest.mark.parametrize("path", ["/", "/schema", "/schema/redoc", "/schema/swagger"])
def test_page_renders_with_nothing_from_other_hosts(live_server: LiveServer, page: Page, path: str) -> None:
    outside = _cut_off_other_hosts(page, live_server.base_url)
    page.goto(f"{live_server.base_url}{path}")
    shows = "Files" if path == "/" else "Upload a JSONL input file"
    expect(page.get_by_text(shows).filter(visible=True).first).to_be_visible()
    page.wait_for_load_state("networkidle")
    assert outside == []


def test_swagger_ui_authorizes_and_uploads_a_file(keyed_server: LiveServer, page: Page) -> None:
    outside = _cut_off_other_hosts(page, keyed_server.base_url)
    page.goto(f"{keyed_server.base_url}/schema/swagger")
    page.get_by_role("button", name="Authorize").first.click()
    page.get_by_label("auth-bearer-value").fill(TENANT_KEYS[0])
    page.get_by_role("button", name="Apply credentials").click()
    page.get_by_role("button", name="Close").click()

    upload = page.locator("#operations-files-V1FilesUpload")
    upload.locator(".opblock-summary").click()
    upload.get_by_role("button", name="Try it out").click()
    upload.locator("input[type=file]").set_input_files(
        files=[{"name": "from-swagger.jsonl", "mimeType": "application/jsonl", "buffer": b'{"custom_id": "a"}\n'}]
    )
    upload.get_by_role("button", name="Execute").click()

    expect(upload.locator(".live-responses-table tbody .response-col_status")).to_have_text("200")
    files = keyed_server.http.get("/v1/files").json()["data"]
    [uploaded] = [file for file in files if file["filename"] == "from-swagger.jsonl"]  # as the key's tenant
    assert uploaded["expires_at"] is None, "the form's optional fields are left blank, so the file is kept"
    assert outside == []
