"""Helpers to drive a live batchgen server from tests: input lines, upload, create, wait, read results."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from batchgen.server.launcher import ServerProcess

TERMINAL = {"completed", "failed", "expired", "cancelled"}
TENANT_KEYS = ("tenant-a-key-0123", "tenant-b-key-4567")
"""The two API keys of the ``keyed_server`` fixture: two tenants."""


def chat_line(custom_id: str, content: str = "Hello!", **body: Any) -> dict[str, Any]:
    """One input line for /v1/chat/completions (demo model, 8 tokens unless ``body`` says otherwise)."""
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **body},
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


class LiveServer:
    """A running server plus thin httpx helpers for tests (the client package has its own, tested separately)."""

    def __init__(
        self,
        process: ServerProcess | None = None,
        api_key: str | None = None,
        *,
        base_url: str = "",
        storage_dir: Path = Path(),
    ) -> None:
        """A server started by ``process``, or one the test runs itself (in-process) at ``base_url``."""
        self.process = process
        self.base_url = process.base_url if process else base_url
        self.storage_dir = process.storage_dir if process else storage_dir
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=30)

    def upload(self, data: bytes | list[dict[str, Any]], filename: str = "input.jsonl") -> dict[str, Any]:
        content = jsonl(data) if isinstance(data, list) else data
        response = self.http.post("/v1/files", data={"purpose": "batch"}, files={"file": (filename, content)})
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    def create_batch(self, input_file_id: str, **fields: Any) -> dict[str, Any]:
        response = self.http.post("/v1/batches", json={"input_file_id": input_file_id, **fields})
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    def batch(self, batch_id: str) -> dict[str, Any]:
        response = self.http.get(f"/v1/batches/{batch_id}")
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    def wait(self, batch_id: str, *, timeout_s: float = 60, until: set[str] = TERMINAL) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            batch = self.batch(batch_id)
            if batch["status"] in until:
                return batch
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch_id} still {batch['status']} after {timeout_s} s: {batch}")
            time.sleep(0.05)

    def run(self, lines: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        """Upload, create, wait: the finished batch."""
        return self.wait(self.create_batch(self.upload(lines)["id"], **fields)["id"])

    def raw(self, file_id: str | None) -> bytes:
        if file_id is None:
            return b""
        response = self.http.get(f"/v1/files/{file_id}/content")
        assert response.status_code == 200, response.text
        return response.content

    def lines(self, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        response = self.http.get(f"/v1/files/{file_id}/content")
        assert response.status_code == 200, response.text
        return [json.loads(line) for line in response.content.splitlines()]


def assert_exactly_once(server: LiveServer, batch: dict[str, Any], lines: list[dict[str, Any]]) -> None:
    """``batch`` completed with every input line answered exactly once across its output and error files, every line
    whole JSON, and counts and usage equal to what the lines say (inputs use ``ignore_eos``: each request generates
    exactly its ``max_tokens``)."""
    assert batch["status"] == "completed", batch
    answered: dict[str, list[dict[str, Any]]] = {}
    for kind in ("output_file_id", "error_file_id"):
        raw = server.raw(batch[kind])
        assert raw == b"" or raw.endswith(b"\n")
        answered[kind] = [json.loads(line) for line in raw.splitlines()]  # a torn line would not parse
    output, errors = answered["output_file_id"], answered["error_file_id"]
    assert Counter(line["custom_id"] for line in output + errors) == Counter(line["custom_id"] for line in lines)
    assert batch["request_counts"] == {"total": len(lines), "completed": len(output), "failed": len(errors)}
    max_tokens = {line["custom_id"]: line["body"]["max_tokens"] for line in lines}
    assert all(line["response"]["status_code"] == 200 for line in output)
    usage = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in output)
    assert batch["usage"]["output_tokens"] == usage == sum(max_tokens[line["custom_id"]] for line in output)


@dataclass
class Reply:
    status: int = 200
    delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


class Receiver:
    """A real HTTP server that answers POSTs with the scripted replies (the last one repeats) and records them."""

    def __init__(self, replies: list[Reply]) -> None:
        self.replies = replies
        self.received: list[Received] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.received.append(Received(self.path, dict(self.headers.items()), body, time.monotonic()))
                reply = receiver.replies[min(len(receiver.received), len(receiver.replies)) - 1]
                time.sleep(reply.delay_s)
                try:
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("content-length", "0")
                    self.end_headers()
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and hung up
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
