"""A streaming client that stops reading costs the server a bounded amount of memory, and one that goes away while
the server's send is blocked has its sequences stopped at once (``api/engine_calls.py``)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import httpx
from server_helpers import LiveServer

BACKLOG_TOKENS = 1000
# Big events (20 top logprobs a token) fill the sockets' kernel buffers (megabytes) in a second or two, after which
# the server's sends block and what the engine generates waits in the server.
STREAM = {"model": "demo", "prompt": "hello", "max_tokens": 1500, "n": 32, "ignore_eos": True, "logprobs": 20}


def _open_stream(server: LiveServer) -> socket.socket:
    """A streamed completion whose client then reads nothing (a small receive buffer, set before connecting)."""
    body = json.dumps({**STREAM, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.connect(("127.0.0.1", server.process.port))  # type: ignore[union-attr]
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    sock.sendall(head.encode() + b"\r\n\r\n" + body)
    return sock


def _metric(server: LiveServer, name: str) -> float:
    lines = server.http.get("/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name + "{"))


def _until(condition: Callable[[], bool], timeout_s: float) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "timed out"
        time.sleep(0.1)
    return time.monotonic() - started


def test_a_stream_nobody_reads_is_stopped_past_its_backlog(server_factory: Callable[..., LiveServer]) -> None:
    server = server_factory("--max-stream-backlog-tokens", str(BACKLOG_TOKENS))
    rss = server.memory_mib()
    generated = _metric(server, "batchgen_generation_tokens_total")
    sock = _open_stream(server)
    try:
        _until(lambda: _metric(server, "batchgen_num_requests_running") == 32, 10)
        _until(lambda: _metric(server, "batchgen_num_requests_running") == 0, 30)  # stopped, not run to the end
        assert _metric(server, "batchgen_generation_tokens_total") - generated < 32 * STREAM["max_tokens"]
        assert server.memory_mib() - rss < 100
        assert server.http.post("/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 1}).is_success
        sock.settimeout(10)
        received = b""
        while b"data: [DONE]" not in received:
            chunk = sock.recv(1 << 20)
            assert chunk, "the stream ended without its last event"
            received += chunk
    finally:
        sock.close()
    error = json.loads(received.split(b"data: ")[-2].split(b"\n")[0])["error"]
    assert error["code"] == "stream_backlog"
    assert f"more than {BACKLOG_TOKENS} generated tokens waited unread" in error["message"]


def test_a_client_gone_while_the_send_is_blocked_is_stopped_at_once(live_server: LiveServer) -> None:
    sock = _open_stream(live_server)
    _until(lambda: _metric(live_server, "batchgen_num_requests_running") == 32, 10)
    time.sleep(3)  # the kernel's buffers are full: the server is blocked sending
    assert _metric(live_server, "batchgen_num_requests_running") == 32
    sock.close()
    assert _until(lambda: _metric(live_server, "batchgen_num_requests_running") == 0, 5) < 2
    response = httpx.post(f"{live_server.base_url}/v1/completions", json={**STREAM, "n": 1, "max_tokens": 1})
    assert response.is_success


def test_a_client_gone_mid_body_is_logged_as_its_doing_not_an_error(live_server: LiveServer) -> None:
    """A body cut short by its client (online, and an upload) is an INFO line; it was a 500's ERROR."""
    log = live_server.process.log_path  # type: ignore[union-attr]
    start = len(log.read_bytes())
    for path, content_type, body in (
        ("/v1/chat/completions", "application/json", b'{"model": "demo", "messages": ['),
        ("/v1/files", "multipart/form-data; boundary=b", b'--b\r\nContent-Disposition: form-data; name="file"'),
    ):
        sock = socket.create_connection(("127.0.0.1", live_server.process.port))  # type: ignore[union-attr]
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\nContent-Length: 4096\r\n\r\n"
        sock.sendall(head.encode() + body)
        time.sleep(0.3)
        sock.close()
    _until(lambda: log.read_bytes()[start:].count(b"the client left before sending its whole body") == 2, 5)
    written = log.read_bytes()[start:].decode()
    assert " ERROR " not in written and "Traceback" not in written, written
