"""Run ``batchgen-server serve`` as a child process on a free loopback port (tests, the demo, benchmarks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Protocol

CLEAN_EXIT_CODES = (0, -signal.SIGTERM)
"""How a server stopped by SIGTERM exits: uvicorn shuts down gracefully, then re-raises the signal."""


class Child(Protocol):
    """The server's process, as this class drives it: a ``subprocess.Popen``, or anything that behaves as one."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


def limit_open_files(count: int | None) -> None:
    """This process's descriptor limit, soft and hard (``ulimit -n``), if ``count`` is set."""
    if count is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (count, count))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """``with ServerProcess(storage_dir) as server: server.base_url`` -- started, healthy, stopped with SIGTERM."""

    def __init__(
        self,
        storage_dir: Path,
        *args: str,
        model: str = "demo",
        startup_timeout_s: float = 180.0,
        env: Mapping[str, str] | None = None,
        open_files: int | None = None,
    ) -> None:
        self.storage_dir = Path(storage_dir)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.storage_dir / "server.log"
        self._args = ["--model", model, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self._startup_timeout_s = startup_timeout_s
        self._env = dict(env or {})
        """Added to the child's environment (a test's fault injection, say)."""
        self._open_files = open_files
        """The child's descriptor limit, soft and hard (``ulimit -n``), if set."""
        self.process: Child | None = None

    def start(self, *, wait: bool = True) -> ServerProcess:
        """Start the server; with ``wait``, return once it is healthy."""
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        # The child sees the same packages as this process, installed or on PYTHONPATH.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **self._env}
        self.process = self._spawn(["serve", "--storage", str(self.storage_dir), *self._args], env)
        if wait:
            self._wait_healthy()
        return self

    def _spawn(self, argv: list[str], env: dict[str, str]) -> Child:
        """``batchgen-server ARGV`` in a new interpreter, its output appended to the log, with the descriptor limit
        asked for."""
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "batchgen.server.cli", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=lambda: limit_open_files(self._open_files),
            )

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {self._startup_timeout_s} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit in time; the exit code."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
