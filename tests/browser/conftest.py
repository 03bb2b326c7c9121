"""One headless Chromium for all the browser tests, driven by Playwright through ``executable_path`` (the system's
browser: Playwright's own download does not work offline). Tests using it skip, saying why, where there is none."""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def find_chromium() -> str | None:
    candidates = [os.environ.get("BATCHGEN_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"]
    return next((path for name in candidates if name and (path := shutil.which(name))), None)


def _why_no_browser() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (it is in the test dependency group)"
    if find_chromium() is None:
        return "no Chromium on PATH: `apt-get install chromium` (nox -s tests does it as root on Debian)"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip before any fixture runs, so no server starts for a test that cannot run."""
    if (reason := _why_no_browser()) is not None:
        for item in items:
            if "browser" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="package")
def browser() -> Iterator[Browser]:
    """Closed when the last browser test is done: Playwright's sync API keeps an asyncio loop running on this thread,
    and tests run after these start their own."""
    from playwright.sync_api import sync_playwright

    executable = find_chromium()
    assert executable is not None
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh tab in its own context (no storage shared with other tests); JavaScript errors fail the test."""
    context = browser.new_context(accept_downloads=True, viewport={"width": 1280, "height": 720})
    context.set_default_timeout(30_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors: {errors}"
