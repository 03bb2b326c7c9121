"""Untrusted grammars compiled first where a crash costs nothing but that grammar: llguidance's compiler is native
code, and a grammar can crash it (3,000 chained Lark rules, or a chain of a few hundred JSON-schema ``$ref``\\ s,
overflow its stack: a segfault, and the whole server with it). Each grammar a request brings is compiled first in a
child process (``python -m batchgen.server.security.grammar_probe``) whose compiling thread has a quarter of the stack
that the engine's compile threads have (``engine/sampling/grammar.py``'s ``COMPILE_STACK_BYTES``), so what compiles here
compiles there with room to spare. A grammar that kills its child, or outlasts the time limit, is refused and costs that
child alone: the next grammar starts a new one.

The children speak over their standard input and output: a ready byte first, then for each grammar its UTF-8 text in
and llguidance's verdict out (``""``: it compiles), each message after its length (4 bytes, big-endian). A child is
the first the kernel's OOM killer takes, within an address space of ``CHILD_MEMORY_BYTES``, its stderr (where Rust
reports a stack overflow) dropped."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

PROBE_STACK_BYTES = 4 * 2**20
"""The probing thread's stack: a Lark chain of ~1,300 rules or ~450 nested ``$ref``\\ s fits (measured: the stack a
grammar needs grows with its nesting, ~3 KB a Lark rule, ~9 KB a ``$ref``), far beyond what a real schema nests."""
CHILDREN = 2
"""Grammars probed at once: a slow one holds one child, at most for the time limit."""
CHILD_MEMORY_BYTES = 4 * 2**30
"""A child's address space: a grammar that makes the compiler allocate without bound fails there alone."""
START_TIMEOUT_S = 30.0
_LENGTH = struct.Struct(">I")
_READY = b"\x01"
log = logging.getLogger("batchgen.server.grammar")


@dataclass(frozen=True, slots=True)
class Verdict:
    problem: str
    """Why the grammar does not compile (``""``: it does)."""
    lasting: bool = True
    """The grammar's own: remembered for it. A time limit run out is not (the machine may have been busy)."""


class GrammarProbe:
    """Asks a child process whether llguidance compiles a grammar; thread-safe, at most ``CHILDREN`` at once (the
    others wait their turn)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.command = [sys.executable, "-m", __name__]
        """What a child runs: this module."""
        self._idle: list[_Child] = []
        self._lock = threading.Lock()
        self._places = threading.BoundedSemaphore(CHILDREN)

    def verdict(self, grammar: str) -> Verdict:
        """Whether ``grammar`` compiles: llguidance's own reason if not, or the child's crash or time limit. A child
        that cannot start is the server's fault: ``RuntimeError``."""
        with self._places:
            with self._lock:
                child = self._idle.pop() if self._idle else None
            if child is None:
                child = _Child.start(self.command)
            try:
                problem = child.ask(grammar.encode("utf-8", "surrogatepass"), self.timeout_s)
            except _Lost as lost:
                child.kill()
                if lost.lasting:
                    log.warning("a grammar %s: it is refused, and a new child checks the next", lost)
                return Verdict(str(lost), lost.lasting)
            with self._lock:
                self._idle.append(child)
            return Verdict(problem)

    def close(self) -> None:
        with self._lock:
            children, self._idle = self._idle, []
        for child in children:
            child.kill()


class _Lost(Exception):
    """The child died on the grammar, or ran out of time: the grammar's refusal."""

    def __init__(self, message: str, *, lasting: bool) -> None:
        super().__init__(message)
        self.lasting = lasting


class _Child:
    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    @classmethod
    def start(cls, command: list[str]) -> _Child:
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True
        )
        child = cls(process)
        try:
            child._read(len(_READY), time.monotonic() + START_TIMEOUT_S, START_TIMEOUT_S)
        except _Lost:
            child.kill()
            raise RuntimeError(f"the grammar checker's process did not start ({' '.join(command)})") from None
        return child

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
                raise _Lost(f"it did not compile within {timeout_s:g} s", lasting=False)
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
        if code is None or code >= 0:  # not the grammar's doing (killed from outside, out of its pipe...)
            return _Lost(f"the grammar checker's process ended (exit code {code}) while compiling it", lasting=False)
        how = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        message = f"compiling it crashed the grammar compiler ({how}); a grammar nested this deeply is not taken"
        return _Lost(message, lasting=True)

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
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text("1000")
    import llguidance  # noqa: F401 (loaded before the ready byte: a child that cannot load it never says ready)

    sys.stdout.buffer.write(_READY)
    sys.stdout.buffer.flush()
    threading.stack_size(PROBE_STACK_BYTES)
    thread = threading.Thread(target=_serve, args=(sys.stdin.buffer, sys.stdout.buffer), name="grammar-probe")
    thread.start()
    thread.join()


if __name__ == "__main__":
    main()
