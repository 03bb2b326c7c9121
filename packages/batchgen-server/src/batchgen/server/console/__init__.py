"""The web console: one static page at ``/`` whose script reads the JSON API from the browser and renders it (no
build step, nothing loaded from elsewhere). With API keys on, the page asks for one and keeps it for the tab only."""

from __future__ import annotations

from pathlib import Path

from litestar import get
from litestar.response import File

from ..static_files import NO_CACHE, SAME_ORIGIN_POLICY, serve_file, static_files

HERE = Path(__file__).parent


@get("/", include_in_schema=False, sync_to_thread=False)
def console_page() -> File:
    return serve_file(HERE / "index.html", {**NO_CACHE, "Content-Security-Policy": SAME_ORIGIN_POLICY})


console_assets = static_files(
    "/console", {name: HERE / name for name in ("console.js", "console.css")}, name="console-assets"
)
