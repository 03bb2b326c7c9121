"""Untrusted grammars compiled first where a crash costs nothing but that grammar: llguidance's compiler is native
code, and a grammar can crash it (3,000 chained Lark rules, or a chain of a few hundred JSON-schema ``$ref``\\ s,
overflow its stack: a segfault, and the whole server with it). Each grammar a request brings is compiled first in a
child process (``python -m batchgen.server.security.grammar_probe``) whose compiling thread has a quarter of the
stack that the engine's compile threads have (``engine/grammar.py``'s ``COMPILE_STACK_BYTES``), so what compiles
here compiles there with room to spare. A grammar that kills its child, or outlasts the time limit, is refused and
costs that child alone: the next grammar starts a new one.

The children speak over their standard input and output: a grammar's UTF-8 text in, llguidance's verdict out (``""``:
it compiles), each message after its length (4 bytes, big-endian)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import BinaryIO

PROBE_STACK_BYTES = 4 * 2**20
"""The probing thread's stack: a Lark chain of ~1,300 rules or ~450 nested ``$ref``\\ s fits (measured: the stack a
grammar needs grows with its nesting, ~3 KB a Lark rule, ~9 KB a ``$ref``), far beyond what a real schema nests."""
CHILDREN = 2
"""Grammars probed at once: a slow one holds one child, at most for the time limit."""
_LENGTH = struct.Struct(">I")


class GrammarProbe:
    """Asks a child process whether llguidance compiles a grammar; thread-safe, at most ``CHILDREN`` at once (the
    others wait their turn)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._idle: list[_Child] = []
        self._lock = threading.Lock()
        self._places = threading.BoundedSemaphore(CHILDREN)

    def problem(self, grammar: str) -> str:
        """Why ``grammar`` does not compile (``""``: it does): llguidance's own reason, or the child's crash or
        time limit."""
        with self._places:
            with self._lock:
                child = self._idle.pop() if self._idle else None
            if child is None:
                child = _Child.start()
            try:
                problem = child.ask(grammar.encode("utf-8", "surrogatepass"), self.timeout_s)
            except _Lost as lost:
                child.kill()
                return str(lost)
            with self._lock:
                self._idle.append(child)
            return problem

    def close(self) -> None:
        with self._lock:
            children, self._idle = self._idle, []
        for child in children:
            child.kill()


class _Lost(Exception):
    """The child died on the grammar, or ran out of time: the grammar's refusal."""


class _Child:
    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    @classmethod
    def start(cls) -> _Child:
        command = [sys.executable, "-m", __name__]
        return cls(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True))

    def ask(self, grammar: bytes, timeout_s: float) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(_LENGTH.pack(len(grammar)) + grammar)
            self.process.stdin.flush()
        except OSError:  # it died (before or while reading it)
            raise self._lost() from None
        deadline = time.monotonic() + timeout_s
        head = self._read(_LENGTH.size, deadline, timeout_s)
        return self._read(_LENGTH.unpack(head)[0], deadline, timeout_s).decode("utf-8", "replace")

    def _read(self, size: int, deadline: float, timeout_s: float) -> bytes:
        assert self.process.stdout is not None
        fd, data = self.process.stdout.fileno(), b""
        while len(data) < size:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise _Lost(f"it did not compile within {timeout_s:g} s")
            chunk = os.read(fd, size - len(data))
            if not chunk:
                raise self._lost()
            data += chunk
        return data

    def _lost(self) -> _Lost:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and code < 0:
            how = f"{signal.Signals(-code).name}" if -code in signal.valid_signals() else f"signal {-code}"
        else:
            how = f"exit code {code}"
        return _Lost(f"compiling it crashed the grammar compiler ({how}); a grammar nested this deeply is not taken")

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)


def _serve(requests: BinaryIO, answers: BinaryIO) -> None:
    from llguidance import LLMatcher

    while head := requests.read(_LENGTH.size):
        grammar = requests.read(_LENGTH.unpack(head)[0]).decode("utf-8", "surrogatepass")
        try:
            problem = LLMatcher.validate_grammar(grammar)
        except Exception as exc:  # a str llguidance cannot take (a lone surrogate), say
            problem = f"{type(exc).__name__}: {exc}"
        answer = problem.encode("utf-8", "replace")
        answers.write(_LENGTH.pack(len(answer)) + answer)
        answers.flush()


def main() -> None:
    """A child: grammars in until its input ends, each compiled on a thread of ``PROBE_STACK_BYTES``."""
    threading.stack_size(PROBE_STACK_BYTES)
    thread = threading.Thread(target=_serve, args=(sys.stdin.buffer, sys.stdout.buffer), name="grammar-probe")
    thread.start()
    thread.join()


if __name__ == "__main__":
    main()
