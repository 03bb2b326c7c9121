"""The console in a real browser: a batch created through the API appears, runs to completed, and its output downloads;
with API keys on, the page asks for a key, keeps it for the tab only and shows that tenant's batches alone."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from server_helpers import TENANT_KEYS, LiveServer, chat_line

if TYPE_CHECKING:
    from playwright.sync_api import Page

expect = pytest.importorskip("playwright.sync_api").expect
SCREENSHOTS = os.environ.get("BATCHGEN_SCREENSHOTS")
"""Where ``test_screenshots`` saves the console's pictures: ``BATCHGEN_SCREENSHOTS=docs pytest tests/browser``."""
LONG_RUN_MS = 90_000
"""A batch on a busy 2-core machine: far above the second or two it takes alone."""


def _download(page: Page, link_text: str) -> bytes:
    with page.expect_download() as started:
        page.locator("#batch-files a", has_text=link_text).click()
    return Path(started.value.path()).read_bytes()


def test_a_batch_appears_runs_to_completed_and_its_output_downloads(live_server: LiveServer, page: Page) -> None:
    page.goto(f"{live_server.base_url}/")
    expect(page.locator("#engine")).to_contain_text("Running")
    expect(page.locator("#health")).to_have_text("demo · healthy")

    lines = [chat_line(f"req-{i}", f"Question {i}", max_tokens=16) for i in range(12)]
    lines.append(chat_line("too-long", "x" * 2100))  # over the demo model's context: a failed request
    batch = live_server.create_batch(live_server.upload(lines)["id"], metadata={"run": "browser"})

    row = page.locator(f'#batches tr[data-batch-id="{batch["id"]}"]')
    expect(row).to_be_visible()  # appears with no reload
    expect(row.locator(".badge")).to_have_text("completed", timeout=LONG_RUN_MS)
    expect(row.locator("progress")).to_have_attribute("value", "13")
    expect(row.locator("progress")).to_have_attribute("max", "13")
    expect(row).to_contain_text("12 ok · 1 failed")
    expect(row.locator("td").last).to_contain_text("tok/s")

    row.get_by_role("link", name=batch["id"]).click()
    expect(page.locator("#batch-title")).to_contain_text(batch["id"])
    expect(page.locator("#batch-details")).to_contain_text("metadata.run")
    expect(page.locator("#batch-errors")).to_contain_text("too-long")
    expect(page.locator("#batch-errors")).to_contain_text("context_length_exceeded")

    finished = live_server.batch(batch["id"])
    output = _download(page, "_output.jsonl")
    assert output == live_server.http.get(f"/v1/files/{finished['output_file_id']}/content").content
    assert len(output.splitlines()) == 12
    errors = _download(page, "_error.jsonl")
    assert b'"custom_id":"too-long"' in errors.replace(b" ", b"")

    page.get_by_role("link", name="All batches").click()
    expect(page.locator("#files")).to_contain_text(f"{batch['id']}_output.jsonl")


def test_a_batch_that_fails_validation_shows_its_line_errors(live_server: LiveServer, page: Page) -> None:
    bad = b'{"custom_id": "x", "method": "POST", "url": "/v1/nope", "body": {}}\n'
    batch = live_server.create_batch(live_server.upload(bad)["id"])
    page.goto(f"{live_server.base_url}/#/batches/{batch['id']}")
    expect(page.locator("#batch-title .badge")).to_have_text("failed", timeout=LONG_RUN_MS)
    error = page.locator("#batch-errors tbody tr").first
    expect(error.locator("td").first).to_have_text("1")  # the line number
    expect(error).to_contain_text("invalid_url")


def test_with_keys_the_console_asks_for_one_and_shows_only_that_tenants_batches(
    keyed_server: LiveServer, page: Page
) -> None:
    mine = keyed_server.run([chat_line("mine")])
    with httpx.Client(base_url=keyed_server.base_url, headers={"Authorization": f"Bearer {TENANT_KEYS[1]}"}) as other:
        upload = other.post("/v1/files", data={"purpose": "batch"}, files={"file": ("x.jsonl", b"{}\n")})
        theirs = other.post("/v1/batches", json={"input_file_id": upload.json()["id"]}).json()

    page.goto(f"{keyed_server.base_url}/")
    form = page.locator("#key-form")
    expect(form).to_be_visible()
    form.locator("input").fill("not-a-key")
    form.locator("input").press("Enter")
    expect(page.locator("#key-error")).to_have_text("Incorrect API key provided.")
    form.locator("input").fill(TENANT_KEYS[0])
    form.locator("input").press("Enter")

    expect(page.locator(f'#batches tr[data-batch-id="{mine["id"]}"] .badge')).to_have_text("completed")
    expect(page.locator(f'#batches tr[data-batch-id="{theirs["id"]}"]')).to_have_count(0)
    expect(page.locator("#files")).not_to_contain_text(upload.json()["id"])
    # The key lives in this tab's sessionStorage only: never on disk, never in another tab.
    assert page.evaluate("sessionStorage.getItem('batchgen.apiKey')") == TENANT_KEYS[0]
    assert page.evaluate("localStorage.length") == 0 and page.context.cookies() == []
    page.reload()
    expect(page.locator(f'#batches tr[data-batch-id="{mine["id"]}"]')).to_be_visible()
    other_tab = page.context.new_page()
    other_tab.goto(f"{keyed_server.base_url}/")
    expect(other_tab.locator("#key-form")).to_be_visible()
    other_tab.close()

    # A link cannot carry the key: the page fetches the file with it.
    page.locator(f'#batches tr[data-batch-id="{mine["id"]}"] a').click()
    output = _download(page, "_output.jsonl")
    assert output == keyed_server.http.get(f"/v1/files/{mine['output_file_id']}/content").content

    page.get_by_role("button", name="Forget key").click()
    expect(form).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('batchgen.apiKey')") is None


@pytest.mark.skipif(not SCREENSHOTS, reason="set BATCHGEN_SCREENSHOTS=docs to remake the console's screenshots")
def test_screenshots(live_server: LiveServer, page: Page) -> None:
    """The pictures in docs/: a finished batch with a failed request, one that failed validation, one running."""
    finished = live_server.run(
        [chat_line(f"q-{i}", f"Question {i}", max_tokens=24) for i in range(40)] + [chat_line("too-long", "x" * 2100)],
        metadata={"project": "nightly-eval"},
    )
    live_server.create_batch(live_server.upload(b'{"custom_id": "x", "method": "POST", "url": "/v1/nope"}\n')["id"])
    running_lines = [chat_line(f"r-{i}", f"Story {i}", max_tokens=256, ignore_eos=True) for i in range(3000)]
    running = live_server.create_batch(live_server.upload(running_lines)["id"])

    page.goto(f"{live_server.base_url}/")
    row = page.locator(f'#batches tr[data-batch-id="{running["id"]}"]')
    expect(row.locator(".badge")).to_have_text("in_progress")
    # The engine counts a request's tokens when it finishes: wait for the first ones, in the batch too.
    generated = page.locator("#engine div", has_text="Generated").locator("dd")
    expect(generated).not_to_have_text(re.compile("^(—|0 tok/s)$"), timeout=LONG_RUN_MS)
    expect(row.locator("progress")).not_to_have_attribute("value", "0", timeout=LONG_RUN_MS)
    page.screenshot(path=f"{SCREENSHOTS}/console.png", full_page=True)
    page.goto(f"{live_server.base_url}/#/batches/{finished['id']}")
    expect(page.locator("#batch-errors")).to_contain_text("context_length_exceeded")
    page.screenshot(path=f"{SCREENSHOTS}/console-batch.png", full_page=True)
    live_server.http.post(f"/v1/batches/{running['id']}/cancel")
    assert live_server.wait(running["id"])["status"] == "cancelled"
