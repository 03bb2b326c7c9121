"""``OPTIONS`` answers list every method of their path.

Litestar's automatic OPTIONS handler reports the methods its route had when the handler was made; a route rebuilt as
its path gains handlers from another registration (a controller inside a router) keeps the first handler, so
``OPTIONS /v1/files`` would leave out ``POST``.
"""

from __future__ import annotations

from litestar.datastructures import MutableScopeHeaders
from litestar.types import Message, Scope


async def allow_route_methods(message: Message, scope: Scope) -> None:
    """A ``before_send`` hook: the ``Allow`` of an OPTIONS answer, from the route that answered it."""
    if message["type"] != "http.response.start" or scope.get("method") != "OPTIONS":
        return
    headers = MutableScopeHeaders.from_message(message)
    template = scope.get("path_template")
    route = next((route for route in scope["app"].routes if route.path_format == template), None)
    if "allow" in headers and route is not None:
        headers["allow"] = ", ".join(sorted(route.methods))
