"""Helpers to drive a live batchgen server from tests: servers forked from a process that has imported the server
once, input lines, upload, create, wait, read results."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from batchgen.server import launcher

FORKS = multiprocessing.get_context("forkserver")
PRELOAD = ["batchgen.server.cli", "batchgen.server.serve", "batchgen.server.app", "batchgen.server.engine.factory"]
FORKS.set_forkserver_preload([*PRELOAD, "transformers.models.llama.modeling_llama", "server_helpers"])
IMPORT_TIME = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "OMP_", "MKL_")
"""Variables the preloaded modules read as they are imported: a server whose environment sets them otherwise than
the fork server's starts in a new interpreter."""
FAULTS = Path(__file__).parent / "faults" / "sitecustomize.py"


class ServerProcess(launcher.ServerProcess):
    """``launcher.ServerProcess``, forked from a process that has imported the server's stack once (torch,
    transformers, litestar, the engine): ready in ~0.5 s rather than ~4, over the suite's dozens of servers."""

    def _spawn(self, argv: list[str], env: dict[str, str]) -> launcher.Child:
        if not forkable(env):
            return super()._spawn(argv, env)
        return forked_cli(argv, Path(self.log_path), env=env, open_files=self._open_files)


_forks_env: dict[str, str] = {}
"""The environment the fork server started with (the import-time variables its modules read)."""


def forkable(env: dict[str, str]) -> bool:
    """Whether a command with this environment may be forked: it sets every variable the preloaded modules read as
    they are imported as the fork server had it."""
    if not _forks_env:  # the fork server starts at the first fork, with this process's environment
        _forks_env.update(os.environ)
    names = {name for name in {*env, *_forks_env} if name.startswith(IMPORT_TIME)}
    return all(env.get(name) == _forks_env.get(name) for name in names)


def forked_cli(
    argv: list[str],
    log_path: Path,
    *,
    env: dict[str, str] | None = None,
    open_files: int | None = None,
    compiled: bool = False,
) -> ForkedChild:
    """``batchgen-server ARGV`` forked from the fork server, its output appended to ``log_path``; ``compiled``: tiny
    models' layers compiled too (``EAGER_BELOW_PARAMETERS`` 0)."""
    environment = dict(os.environ if env is None else env)
    assert forkable(environment), (
        "a variable read at import differs from the fork server's: run it in a new interpreter"
    )
    process = FORKS.Process(target=_run_cli, args=(argv, environment, str(log_path), open_files, compiled))
    process.start()
    return ForkedChild(process)


class ForkedChild:
    """A forked command as ``subprocess.Popen`` shows a child: ``returncode`` negative for a signal."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        code: int | None = self._process.exitcode
        return code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_cli(argv: list[str], env: dict[str, str], log_path: str, open_files: int | None, compiled: bool) -> None:
    """A forked command's body: the environment, output and limits a new interpreter would have had, then the CLI."""
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    launcher.limit_open_files(open_files)
    if env.get("BATCHGEN_TEST_CRASH_MARKER"):  # what tests/faults/sitecustomize.py does at a new interpreter's start
        runpy.run_path(str(FAULTS))
    if compiled:
        from batchgen.server.engine.runner import model_runner

        model_runner.EAGER_BELOW_PARAMETERS = 0
    from batchgen.server.cli import main

    gc.freeze()  # the fork server's imports: the server's start-up collection (startup_heap.py) skips them
    sys.exit(main(argv))


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

    def memory_mib(self, field: str = "VmRSS") -> int:
        """The server's resident memory now (``VmRSS``), or at its peak since ``reset_peak_memory`` (``VmHWM``)."""
        status = Path(f"/proc/{self._pid}/status").read_text()
        return int(status.split(f"{field}:")[1].split()[0]) // 1024

    def reset_peak_memory(self) -> None:
        Path(f"/proc/{self._pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)

    @property
    def _pid(self) -> int:
        assert self.process is not None and self.process.process is not None
        return self.process.process.pid

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
