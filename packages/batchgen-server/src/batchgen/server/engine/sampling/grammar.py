"""Grammar-constrained decoding with llguidance: grammars compiled once by their canonical text, off the step thread
and within a time limit; a matcher per constrained sequence; each step's token masks filled (in parallel, without
the GIL) while the forward runs, for the sampler to apply.

llguidance over xgrammar (``benchmarks/structured.py``, RESULTS.md): on CPU it compiles the schemas of a real-world
corpus about 10x faster (p50 1.6 ms, p99 3.8 ms against 15 and 200 ms at 32k tokens), refuses by name a JSON-schema
keyword it does not implement where xgrammar ignores it (so ``strict`` can be honoured), and ships as one small wheel
with no Python dependency, where xgrammar pulls in torch, triton and transformers of its own choosing. Its masks cost
more per token (computed lazily, 67 us against 11 at 32k tokens), which the fill hides behind the forward.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..request import MAX_REASON_CHARS, GrammarError, grammar_key

if TYPE_CHECKING:
    import llguidance

CACHE_SIZE = 1024
"""Grammars whose compilation is kept, by the hash of their text: a template matcher (the size of its grammar's
automata), or the one-line reason it was refused. No grammar's text is kept."""
MAX_ITEMS_IN_ROW = 20_000
"""llguidance's parser limits, raised from 2,000 and 50,000: an object of N optional properties puts about 4N items in
a row, so its default refused, at the first token, any schema past 500 properties; these take up to 5,000, at up to
about 17 ms a mask (measured, 4,900 properties)."""
STEP_MAX_ITEMS = 200_000
COMPILE_THREADS = 2
"""Compilations run at once (llguidance releases the GIL while it compiles)."""
COMPILE_STACK_BYTES = 16 * 2**20
"""A compile thread's stack: four times the one every grammar was first compiled on, in a process of its own
(``security/grammar_probe.py``), so no grammar that got through there overflows it here."""
_stack_lock = threading.Lock()


class GrammarCompiler:
    """Compiles llguidance grammars for one tokenizer and vocabulary, each once (cached by its text's hash), in
    threads of their own (``Compilations``) so that neither the API's event loop nor the engine's step thread ever
    waits on one. Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, timeout_s: float) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        """The logits' width: the masks cover it (tokens past the tokenizer's are never allowed)."""
        self.timeout_s = timeout_s
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[bytes, Future[llguidance.LLMatcher]] = OrderedDict()
        self._lock = threading.Lock()
        self._runs = Compilations(COMPILE_THREADS, timeout_s)
        self._executor: llguidance.LLExecutor | None = None

    def start(self, grammar: str) -> Future[llguidance.LLMatcher]:
        """The grammar's template matcher (at its start), compiled or being compiled; the future fails with a
        ``GrammarError`` if it does not compile, or not within the time limit. Returns at once."""
        key = grammar_key(grammar)
        with self._lock:
            future = self._compiled.get(key)
            if future is not None:
                self._compiled.move_to_end(key)
                return future
            future = self._compiled[key] = Future()
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._runs.run(lambda: self._build(grammar), future, late=lambda template: self._late(key, future, template))
        return future

    def _late(self, key: bytes, given_up: Future[llguidance.LLMatcher], template: llguidance.LLMatcher) -> None:
        """A compilation given up on finished after all: later requests of its grammar take it."""
        with self._lock:
            if self._compiled.get(key) is given_up:
                done: Future[llguidance.LLMatcher] = Future()
                done.set_result(template)
                self._compiled[key] = done

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """The grammar's template matcher, waiting for it (within the time limit); ``GrammarError`` if it does not
        compile."""
        return self.start(grammar).result()

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher of ``grammar`` (at once, once ``start``'s future is done)."""
        return self.compile(grammar).deep_copy()

    def _build(self, grammar: str) -> llguidance.LLMatcher:
        import llguidance

        limits = llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW, step_max_items=STEP_MAX_ITEMS)
        template = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar, log_level=0, limits=limits)
        if template.is_error():
            raise GrammarError(template.get_error()[:MAX_REASON_CHARS])
        return template

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        """Built once (about a second for a large vocabulary), on first use."""
        with self._lock:
            if self._lltokenizer is None:
                import llguidance.hf

                self._lltokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
            return self._lltokenizer

    def fill(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """Each matcher's next-token mask, ``[len(matchers), ceil(vocab / 32)]`` int32 bits, computed in parallel in
        native code (the GIL released: the forward goes on meanwhile)."""
        import llguidance
        import llguidance.torch

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        masks = torch.empty((len(matchers), (self.vocab_size + 31) // 32), dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], masks)
        return masks


class Compilations:
    """Runs compilations, ``threads`` at a time, each in a thread of its own, and gives up on one that runs past
    ``timeout_s``: its future fails then and its place goes to the next at once. Native code cannot be interrupted,
    so the thread given up on runs to its end (llguidance bounds a compilation's work) and is then forgotten: slow
    grammars never hold places that later ones need."""

    def __init__(self, threads: int, timeout_s: float) -> None:
        self.threads = threads
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._queue: deque[tuple[Callable[[], Any], Future[Any], Callable[[Any], None]]] = deque()
        self._running = 0
        """Places taken: compilations started and neither finished nor given up on."""

    def run(self, work: Callable[[], Any], future: Future[Any], late: Callable[[Any], None]) -> None:
        """Settle ``future`` with ``work()``'s result or exception (a ``GrammarError`` past the time limit); ``late``
        takes the result of a compilation that finished after it was given up on."""
        with self._lock:
            self._queue.append((work, future, late))
            self._start_more()

    def _start_more(self) -> None:
        """Under the lock."""
        while self._running < self.threads and self._queue:
            task = self._queue.popleft()
            self._running += 1
            thread = threading.Thread(target=self._run, args=task, name="batchgen-grammar", daemon=True)
            with _stack_lock:  # the stack size is the process's setting for the threads it starts next
                previous = threading.stack_size(COMPILE_STACK_BYTES)
                try:
                    thread.start()
                finally:
                    threading.stack_size(previous)

    def _run(self, work: Callable[[], Any], future: Future[Any], late: Callable[[Any], None]) -> None:
        timer = threading.Timer(self.timeout_s, self._give_up, (future,))
        timer.daemon = True
        timer.start()
        try:
            result, error = work(), None
        except BaseException as exc:  # the request's fault, whatever it is: it fails alone
            result, error = None, exc if isinstance(exc, GrammarError) else GrammarError(f"{type(exc).__name__}: {exc}")
        timer.cancel()
        with self._lock:  # settled under the lock: the timer may be firing meanwhile
            given_up = future.done()  # its place was freed then
            if not given_up:
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
                self._running -= 1
                self._start_more()
        if given_up and error is None:
            late(result)

    def _give_up(self, future: Future[Any]) -> None:
        with self._lock:
            if future.done():
                return
            future.set_exception(GrammarError(f"it did not compile within {self.timeout_s:g} s"))
            self._running -= 1
            self._start_more()


class MaskFill:
    """One step's masks, filled in a thread of their own while the step's forward runs (``result`` waits): each
    constrained logits row's mask (``owners``: its matcher), as ``token_bias`` for a CPU step (the unpacking hidden
    behind the forward too), packed for a GPU one (unpacked there, where it is cheap and the transfer small)."""

    _threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgen-masks")

    def __init__(
        self, compiler: GrammarCompiler, matchers: list[llguidance.LLMatcher], owners: np.ndarray, device: torch.device
    ) -> None:
        self._future = self._threads.submit(self._fill, compiler, matchers, owners, device)

    @staticmethod
    def _fill(
        compiler: GrammarCompiler, matchers: list[llguidance.LLMatcher], owners: np.ndarray, device: torch.device
    ) -> torch.Tensor:
        masks = compiler.fill(matchers)[torch.from_numpy(owners)]
        return token_bias(masks, compiler.vocab_size) if device.type == "cpu" else masks

    def result(self) -> torch.Tensor:
        return self._future.result()


_COMPILERS: weakref.WeakValueDictionary[tuple[int, int], GrammarCompiler] = weakref.WeakValueDictionary()
"""Kept while an engine holds them (a restarted engine, another model, leaves none behind)."""
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int, timeout_s: float) -> GrammarCompiler:
    """The process's compiler for this tokenizer and vocabulary: the API (validating a request) and the engine
    (running it) share its cache, so a grammar compiles once."""
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get((id(tokenizer), vocab_size))
        if compiler is None:  # the compiler holds the tokenizer: its id is never reused while it lives
            compiler = GrammarCompiler(tokenizer, vocab_size, timeout_s)
            _COMPILERS[(id(tokenizer), vocab_size)] = compiler
        return compiler


_BITS = torch.arange(32, dtype=torch.int32)
_MINUS_INFINITY = np.uint32(0xFF800000)
"""The bits of float32 ``-inf``."""


def token_bias(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """The packed int32 masks (bit ``t % 32`` of word ``t // 32``: token ``t`` allowed) as ``[rows, vocab]`` float32
    logit biases: 0 for an allowed token, ``-inf`` for the others; added to the logits, a vectorised add (a masked
    fill of a random mask is branchy: ten times slower on CPU)."""
    if masks.device.type == "cpu":  # numpy's unpacking, and -inf as bits: no float arithmetic (0 x -inf is NaN)
        forbidden = np.unpackbits(~masks.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(np.multiply(forbidden, _MINUS_INFINITY, dtype=np.uint32).view(np.float32))
    allowed = ((masks.unsqueeze(-1) >> _BITS.to(masks.device)) & 1).view(masks.shape[0], -1)[:, :vocab].bool()
    return torch.zeros(allowed.shape, device=masks.device).masked_fill_(~allowed, float("-inf"))
