"""Serve a fixed set of packaged files by name (the console, the API docs pages' scripts): any other name is a 404,
so no request can reach a file outside the set."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from litestar import get
from litestar.exceptions import NotFoundException
from litestar.handlers import HTTPRouteHandler
from litestar.response import File

SAME_ORIGIN_POLICY = (
    "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
"""The Content-Security-Policy of the pages: the browser loads nothing from another host (so a page works offline and
tells no one it was opened), and nobody may frame them."""
NO_CACHE = {"Cache-Control": "no-cache"}
"""Revalidate every time (the files carry an ETag): a page never runs a script left over from an older version."""


def serve_file(path: Path, headers: Mapping[str, str] = NO_CACHE) -> File:
    return File(path, filename=path.name, content_disposition_type="inline", headers=dict(headers))


def static_files(path: str, files: Mapping[str, Path], *, name: str) -> HTTPRouteHandler:
    """``GET {path}/{file_name}`` for each name in ``files``."""

    @get(f"{path}/{{file_name:str}}", name=name, include_in_schema=False, sync_to_thread=False)
    def serve(file_name: str) -> File:
        if file_name not in files:
            raise NotFoundException()
        return serve_file(files[file_name])

    return serve
