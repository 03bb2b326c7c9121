"""The API docs pages and the console as served (no browser): same-origin assets only, the OpenAPI document's
upload form, security scheme and media types, the console's page and its engine counters."""

from __future__ import annotations

from server_helpers import LiveServer, chat_line


def test_pool_status_counts_the_engine_tokens(live_server: LiveServer) -> None:
    before = live_server.http.get("/v1/pool/status").json()
    batch = live_server.run([chat_line(f"t{i}") for i in range(3)])
    after = live_server.http.get("/v1/pool/status").json()
    assert after["generated_tokens"] - before["generated_tokens"] >= batch["usage"]["output_tokens"] > 0
    assert after["prompt_tokens"] - before["prompt_tokens"] >= batch["usage"]["input_tokens"] > 0
