"""Connections an attacker holds open cannot take the server: idle ones are closed, their number stays under the
descriptor limit, and the server keeps answering and running batches meanwhile (``batchgen.server.connections``)."""

from __future__ import annotations

import asyncio
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from server_helpers import LiveServer, ServerProcess, chat_line

from batchgen.server.connections import ConnectionGuard, guarded_protocol

START_TIMEOUT_S = 3
IDLE_SOCKETS = 1100


def _idle_sockets(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that send nothing, opened a few dozen at a time, each few dozen left a moment for the
    server to accept (a flood faster than that overflows its accept queue, and each SYN it drops waits out the
    kernel's 1 s retry: seconds of the test for nothing it checks)."""
    sockets: list[socket.socket] = []
    while len(sockets) < count:
        sockets += [socket.create_connection(("127.0.0.1", port)) for _ in range(min(32, count - len(sockets)))]
        time.sleep(0.01)
    return sockets


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@pytest.fixture(scope="module")
def capped_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server whose descriptor limit is systemd's usual 1024 (soft and hard), as the attack found it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard) < 3 * IDLE_SOCKETS:
        pytest.skip(f"this test opens {2 * IDLE_SOCKETS} sockets; the descriptor limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    args = ("--request-start-timeout-s", str(START_TIMEOUT_S))
    with ServerProcess(tmp_path_factory.mktemp("server"), *args, open_files=1024) as process:
        assert process.process is not None
        limits = Path(f"/proc/{process.process.pid}/limits").read_text()
        assert [line.split()[3:5] for line in limits.splitlines() if line.startswith("Max open files")] == [
            ["1024", "1024"]
        ]
        server = LiveServer(process)
        yield server
        server.http.close()


def test_idle_sockets_past_the_descriptor_limit_take_nothing(capped_server: LiveServer) -> None:
    server = capped_server
    log_size = server.process.log_path.stat().st_size  # type: ignore[union-attr]
    idle = _idle_sockets(server.process.port, IDLE_SOCKETS)  # type: ignore[union-attr]
    try:
        lines = [chat_line(f"r{i}", max_tokens=4) for i in range(200)]
        batch = server.create_batch(
            server.upload(lines)["id"], endpoint="/v1/chat/completions", completion_window="24h"
        )
        idle += _idle_sockets(server.process.port, IDLE_SOCKETS)  # type: ignore[union-attr]
        for _ in range(3):  # a new client each time: a fresh connection, past 2,200 idle ones
            started = time.monotonic()
            with httpx.Client(base_url=server.base_url, timeout=10) as fresh:
                assert fresh.get("/health").status_code == 200
            assert time.monotonic() - started < 5
        done = server.wait(batch["id"], timeout_s=120)
        assert done["status"] == "completed"
        assert done["request_counts"] == {"total": 200, "completed": 200, "failed": 0}
        time.sleep(START_TIMEOUT_S + 1)
        assert all(_closed_by_peer(sock) for sock in idle[:IDLE_SOCKETS])  # accepted, then closed for sending nothing
    finally:
        for sock in idle:
            sock.close()
    grown = server.process.log_path.stat().st_size - log_size  # type: ignore[union-attr]
    assert grown < 20_000, server.process.log_tail()  # type: ignore[union-attr]


def test_a_request_head_sent_a_byte_at_a_time_is_cut_off(capped_server: LiveServer) -> None:
    sock = socket.create_connection(("127.0.0.1", capped_server.process.port))  # type: ignore[union-attr]
    started = time.monotonic()
    try:
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            if _closed_by_peer(sock):
                break
            sock.setblocking(True)
            time.sleep(0.2)
        elapsed = time.monotonic() - started
    finally:
        sock.close()
    assert START_TIMEOUT_S - 0.5 < elapsed < START_TIMEOUT_S + 2


@pytest.fixture()
def guarded_app() -> Iterator[tuple[str, threading.Event]]:
    """A real uvicorn with the guarded protocol, at most 2 connections, over an app that answers once released."""
    release = threading.Event()

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":
            while not release.is_set():
                await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    guard = ConnectionGuard(max_connections=2, request_start_timeout_s=30)
    config = uvicorn.Config(app, http=guarded_protocol(guard), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", release
    finally:
        release.set()
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_past_the_cap_an_idle_connection_makes_room_and_busy_ones_get_503(
    guarded_app: tuple[str, threading.Event],
) -> None:
    url, release = guarded_app
    port = int(url.rsplit(":", 1)[1])
    idle = socket.create_connection(("127.0.0.1", port))
    time.sleep(0.1)
    with httpx.Client(base_url=url, timeout=10) as fresh:
        assert fresh.get("/fast").text == "ok"  # the cap is 2: fine so far
    time.sleep(0.1)
    assert _closed_by_peer(idle) is False
    busy = [threading.Thread(target=httpx.get, args=(f"{url}/slow",), kwargs={"timeout": 10}) for _ in range(2)]
    for thread in busy:
        thread.start()
    deadline = time.monotonic() + 10  # the busy requests reach the server when the (loaded) machine lets them
    while not _closed_by_peer(idle) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _closed_by_peer(idle)  # two busy connections came: the idle one gave its place
    refused = httpx.get(f"{url}/fast", timeout=10)
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "too_many_connections"
    release.set()
    for thread in busy:
        thread.join()
    assert httpx.get(f"{url}/fast", timeout=10).text == "ok"
