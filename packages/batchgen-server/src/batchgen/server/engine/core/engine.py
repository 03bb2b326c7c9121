"""LLMEngine: the facade the server and run-batch use. A step reads as schedule -> run -> process outputs: the
scheduler decides what runs (``scheduler.py``), the model runner turns that into the step's inputs, runs the forward
and samples (``model_runner.py``), and the output processor commits the tokens and makes the results
(``output_processor.py``)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from transformers import PreTrainedModel

from ..config import EngineConfig
from ..errors import GroupFailed, ModelLoadError
from ..features.adapters import AdapterRefused, Adapters
from ..features.lora import LoRASlots
from ..features.pooling import Pooler
from ..interface import EngineStats
from ..ops.fast_paths import FastPathOff
from ..request import EngineError, EngineRequest, EngineResult, GrammarError, Task, admission_error
from ..runner.capacity import UNDECLARED_CONTEXT
from ..runner.launched import Launched
from ..runner.model_runner import ModelRunner, StepMirror
from ..sampling.grammar import compiler_for
from ..scheduler_output import ScheduledSeq
from ..sequence import RequestState, Sequence, Status
from .block_manager import BlockManager
from .output_processor import OutputProcessor
from .scheduler import Scheduler
from .step_costs import StepCosts


class LLMEngine:
    tasks: frozenset[Task] = frozenset({"generate", "embed"})

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        config: EngineConfig,
        model_name: str,
        pooler: Pooler = Pooler(),  # noqa: B008 (frozen)
        pooling_only: bool = False,
        group: StepMirror | None = None,
    ) -> None:
        """``pooler``: how an ``embed`` request's prompt is pooled; ``pooling_only``: the model (an embedding model,
        a classifier, a reranker) only pools, through its base model's forward (``ModelRunner``), never generates;
        ``group``: the other ranks of a tensor-parallel group, whose driver this engine is (``distributed/``)."""
        config.apply_torch_threads()
        if pooling_only:
            self.tasks = frozenset({"embed"})
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size: int = model.config.get_text_config().vocab_size
        """Token ids a request may name (prompt, stop tokens, logit bias): rows of the embedding and of the logits."""
        self.grammars = compiler_for(tokenizer, self.vocab_size, config.grammar_timeout_s)
        self.runner = ModelRunner(model, config, self.grammars, group, pooling_only)
        self.async_scheduling = config.uses_async_scheduling(self.runner.device)
        model_limit = config.max_model_len or getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if model_limit is None and not self.runner.cache.k:  # no attention: its state does not grow with the context
            model_limit = UNDECLARED_CONTEXT
        if model_limit is None:
            raise ValueError("the model config names no max_position_embeddings; set max_model_len")
        self.max_context_length: int = min(model_limit, self.runner.num_blocks * config.block_size)
        self.eos_token_ids = frozenset(token for token in _eos_ids(model, tokenizer) if token < self.vocab_size)
        self._seeds = random.Random(config.seed)
        self._requests: dict[str, RequestState] = {}
        self.lora: LoRASlots | None = self.runner.lora
        self.step_costs = StepCosts(config.max_mixed_step_ratio, config.block_size)
        # On CPU the step is this thread's work: its CPU time, which other processes on shared cores do not swing.
        self._step_clock = time.thread_time if self.runner.device.type == "cpu" else time.perf_counter
        self.scheduler = Scheduler(
            self._fresh_cache(),
            self.runner.max_num_seqs,
            config.max_num_batched_tokens,
            lambda src, dst: self.runner.copy_block(src, dst),  # the runner's now: a group restart replaces it
            self.runner.seats,
            step_costs=self.step_costs,
        )
        self._pooled_from_last = pooler.mode == "last"
        self.outputs = OutputProcessor(tokenizer, self.scheduler, self._requests, pooler)
        self._ready: list[EngineResult] = []
        self._step: list[ScheduledSeq] | None = None
        """What the step being run holds (its requests are the suspects if it fails); ``None`` between steps and while
        scheduling."""
        self._in_flight: Launched | None = None
        self.served_adapters = Adapters.of(config).served() if self.lora else []
        """The adapters ``--lora-modules`` serves, their weights read: one that cannot be served is refused now."""
        for adapter in self.served_adapters:
            assert self.lora is not None
            try:
                self.lora.weights(adapter)
            except AdapterRefused as exc:
                raise ModelLoadError(f"--lora-modules: {exc}") from None

    def reset(self) -> None:
        """Forget every request and start from an empty cache (the weights and the cache tensors stay): how the
        worker recovers from a step that failed in a way it could not pin on a request. A tensor-parallel group that
        failed is started again whole, every rank's shard loaded again."""
        if (group := self.runner.group) is not None and group.broken:
            self.runner = group.restarted(self.grammars)
            self.lora = self.runner.lora  # the new shards' slots (empty: read again)
            self.scheduler.seats = self.runner.seats
        self.scheduler.reset(self._fresh_cache())
        self.runner.reset()
        self._requests.clear()
        self._ready = []
        self._step = None
        self._in_flight = None

    def close(self) -> None:
        """A split model's worker ranks stopped and its process group left now, not when this process ends (a server
        that stops its engine and goes on, as the tests' in-process servers do, may start another group)."""
        if self.runner.group is not None:
            self.runner.group.stop()

    def idle_fault(self) -> Exception | None:
        """Between steps: a rank of its tensor-parallel group that exited meanwhile, as the failure the worker restarts
        the engine for (so ``/health`` says so at once, and the group is back before the next request)."""
        group = self.runner.group
        return group.failed(RuntimeError("a rank exited")) if group is not None and group.broken else None

    def _fresh_cache(self) -> BlockManager:
        states = self.runner.states.slots if self.runner.states is not None else None
        return BlockManager(self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching, states)

    # ---- requests in and out -----------------------------------------------------------------------------------

    def prepare(self, request: EngineRequest) -> list[Future[Any]]:
        """Start what ``request`` needs before it is added, each in a thread of its own: its grammar's compilation,
        its LoRA adapter's weights. Returns at once; ``add_request`` waits on nothing once every future is done (a
        failure among them is the request's, answered when it is added). Thread-safe."""
        futures: list[Future[Any]] = []
        if request.params.grammar is not None:
            futures.append(self.grammars.start(request.params.grammar))
        if request.lora is not None and self.lora is not None:
            futures.append(self.lora.read(request.lora))
        return futures

    def add_request(self, request: EngineRequest) -> None:
        params = request.params
        prompt_len = len(request.prompt_token_ids)
        max_len = min(self.max_context_length, params.max_context_length or self.max_context_length)
        error = admission_error(request, max_len, self._requests, self.vocab_size)
        matcher = None
        if error is None and params.grammar is not None:
            try:
                matcher = self.grammars.matcher(params.grammar)
            except GrammarError as exc:
                error = EngineError("invalid_grammar", f"The grammar cannot be used: {exc}")
        if error is None and request.lora is not None:
            error = self._adapter_error(request)
        if error is None and request.task not in self.tasks:
            error = EngineError(
                "unsupported_endpoint", f"Model {self.model_name!r} is a pooling model: it generates no text."
            )
        if error is not None:
            self._ready.append(EngineResult(request.request_id, prompt_len, error=error))
            return
        max_tokens = max_len - prompt_len if params.max_tokens is None else min(params.max_tokens, max_len - prompt_len)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        state = RequestState(request, max_len, max_tokens, frozenset(stop_ids), seed)
        state.reads_cache_when_pooled = self._pooled_from_last
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * prompt_len
        seq = state.new_sequence(list(request.prompt_token_ids), 0, self.tokenizer)
        seq.matcher, seq.grammar_active = matcher, not params.grammar_after
        state.seqs.append(seq)
        self._requests[request.request_id] = state
        self.scheduler.add(state.seqs[0])

    def _adapter_error(self, request: EngineRequest) -> EngineError | None:
        """Why the request's LoRA adapter cannot run (LoRA is off, the adapter is refused), or ``None``."""
        assert request.lora is not None
        if self.lora is None:
            return EngineError("model_not_found", f"LoRA adapters are not enabled: no adapter {request.lora.name!r}.")
        try:
            self.lora.weights(request.lora)
        except AdapterRefused as exc:
            return EngineError("invalid_adapter", str(exc))
        return None

    def abort_request(self, request_id: str) -> bool:
        """Drop a request at once (no result is produced for it); ``False`` if it is unknown or already done."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        for seq in state.seqs:
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq)
        self.runner.update_states(self.scheduler.changes())
        return True

    def suspects(self) -> list[str]:
        """After a step failed beyond the engine's own recovery: the requests it was running (those scheduled, or
        if scheduling itself failed, or the failure came between steps, those the scheduler is running)."""
        if self._step is not None:
            return _request_ids(item.seq for item in self._step)
        return _request_ids(self.scheduler.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._ready)

    def reset_stats(self) -> None:
        """Forget the steps run so far (the load-time self-check's): their counts, and the step costs they taught."""
        self.outputs.totals = dict.fromkeys(self.outputs.totals, 0)
        self.scheduler.num_preemptions = 0
        self.step_costs.forget()

    def stats(self) -> EngineStats:
        scheduler, totals, states = self.scheduler, self.outputs.totals, self.runner.states
        return EngineStats(
            queued=len(scheduler.waiting),
            running=len(scheduler.running),
            kv_blocks_total=scheduler.block_manager.num_blocks,
            kv_blocks_free=scheduler.block_manager.num_free_blocks,
            prompt_tokens=totals["prompt"],
            cached_tokens=totals["cached"],
            generated_tokens=totals["generated"],
            preemptions=scheduler.num_preemptions,
            kv_cache_tokens=self.runner.num_blocks * self.config.block_size,
            kv_cache_bytes=self.runner.num_blocks * self.runner.block_bytes,
            kv_cache_dtype=str(self.runner.cache_dtype).removeprefix("torch."),
            state_slots=states.cache.num_slots if states is not None else 0,
            state_checkpoints=states.slots.published if states is not None else 0,
            state_bytes_per_seq=states.slot_bytes if states is not None else 0,
            state_cache_bytes=states.total_bytes if states is not None else 0,
            fast_paths=tuple(path.state() for path in self.runner.paths),
        )

    # ---- one step ----------------------------------------------------------------------------------------------

    def step(self) -> list[EngineResult]:
        """Schedule a step and run it; return the requests that finished, and the partial results of streamed
        requests that moved.

        With async scheduling (``EngineConfig.async_scheduling``), a step is launched and left running: the host
        reads its sampled tokens only after it has scheduled and launched the next one, whose inputs take those
        tokens on the device. So the host's work between steps (scheduling, packing inputs, reading results, stop
        checks, detokenising) runs while the device computes, and results come one step later. A sequence that a
        step ends on a stop token or string computes one more token in the next for nothing (one that ends by
        length does not: that is known at launch). Steps after which the next one needs the host to know their
        tokens (penalties, ``n`` > 1 forks, embeddings) are read before the next is scheduled."""
        started = self._step_clock()
        finished, self._ready = self._ready, []
        if self._in_flight is not None and not self._in_flight.overlappable:
            self._settle(finished)
        self._step = None
        output = self.scheduler.schedule()
        scheduled = self._step = output.scheduled
        self.runner.update_states(output)
        now = time.time()
        for item in scheduled:
            if item.seq.state.scheduled is None:
                item.seq.state.scheduled = now
        launched = self._launch(scheduled, finished) if scheduled else None
        if self._in_flight is not None:
            self._settle(finished)
        self._in_flight = launched
        if launched is not None and (not self.async_scheduling or not self._requests):
            self._settle(finished)  # one step at a time; or every request ended, and what runs is not wanted
        self.runner.update_states(self.scheduler.changes())  # the rows of the sequences the step ended go back now
        self._step = None  # it went through (and holds no finished request's state past its step)
        self.step_costs.observe(self._step_clock() - started, scheduled)
        return finished

    def _launch(self, scheduled: list[ScheduledSeq], finished: list[EngineResult]) -> Launched | None:
        """Start the step, and leave it in flight. If starting fails: with no step in flight, isolate the fault;
        else settle that step first, and run this one again from there, one step at a time."""
        try:
            return self._start(scheduled)
        except GroupFailed:
            raise  # no request's fault: the worker starts the group again
        except FastPathOff as off:  # the step again, from scratch, on the plain path: the fast one is off if it serves
            if self._in_flight is not None:
                self._settle(finished)
            with off.path.bypassed():
                whole = self._run(scheduled, finished)
            if whole:  # else the plain path failed too: the inputs' fault, isolated, and the fast path stays
                off.path.switch_off(off.reason)
            return None
        except Exception as exc:
            if self._in_flight is None:
                self._isolate(scheduled, exc, finished)
            else:
                self._settle(finished)
                self._run(scheduled, finished)
            return None

    def _run(self, scheduled: list[ScheduledSeq], finished: list[EngineResult]) -> bool:
        """With no step in flight: launch the step and settle it at once (``_launch`` isolates a fault); whether it
        ran whole."""
        scheduled = [item for item in scheduled if item.seq.status is Status.RUNNING]  # not failed or ended meanwhile
        if self.runner.states is not None:  # the failed attempt may have advanced their states: from scratch
            scheduled = [rewound(item) for item in scheduled]
        if not scheduled:
            return True
        self._in_flight = self._launch(scheduled, finished)
        if self._in_flight is None:
            return False
        self._settle(finished)
        return True

    def _isolate(self, scheduled: list[ScheduledSeq], exc: Exception, finished: list[EngineResult]) -> None:
        """After the sequences failed to compute together: compute them again in halves, down to one, so that only
        the request(s) that make it fail are failed (with a ``server_error`` result) and everyone else's step goes
        on. Starting a step changes no engine state until its forward and sampling are launched, and sampling is
        stateless, so a retried half gives exactly what the whole would have."""
        if len(scheduled) == 1:
            self.outputs.fail(scheduled[0].seq.state, exc, finished)
            return
        half = len(scheduled) // 2
        self._run(scheduled[:half], finished)
        self._run(scheduled[half:], finished)

    def _start(self, scheduled: list[ScheduledSeq]) -> Launched:
        """Run and sample a step, leaving it on the device; then advance its sequences as if it were done: their
        computed tokens count, and each sampled one holds a ``PENDING`` token until the step is settled."""
        launched = self.runner.execute(scheduled, self.scheduler.block_manager.tables.array, self._in_flight)
        self.scheduler.advance(scheduled, launched.token_rows)
        return launched

    def _settle(self, finished: list[EngineResult]) -> None:
        """Read the step in flight back (waiting for the device) and commit it."""
        launched, self._in_flight = self._in_flight, None
        assert launched is not None
        try:
            token_ids, logprobs = launched.sampled.read() if launched.sampled is not None else ([], [])
            prompt = launched.prompt.read() if launched.prompt is not None else []
        except Exception:  # the device failed running it (not the step just scheduled): its requests are suspect
            self._step = launched.scheduled
            raise
        self.outputs.commit(launched, token_ids, logprobs, prompt, finished)


def rewound(item: ScheduledSeq) -> ScheduledSeq:
    """``item`` computed again from the sequence's first token: the step's tokens and every one before them (their
    K/V are rewritten alike), so that its state layers start from no state rather than from one a failed step may
    have advanced part of the way."""
    seq = item.seq
    if not seq.num_computed_tokens:
        return item
    total = seq.num_computed_tokens + item.num_tokens
    seq.num_computed_tokens = 0
    return ScheduledSeq(seq, total)


def _request_ids(seqs: Iterable[Sequence]) -> list[str]:
    return list(dict.fromkeys(seq.state.request.request_id for seq in seqs))


def _eos_ids(model: PreTrainedModel, tokenizer: Any) -> frozenset[int]:
    """Every end-of-sequence id the model's config, its generation config and its tokenizer name."""
    ids: set[int] = set()
    sources = [model.config.get_text_config(), getattr(model, "generation_config", None)]
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else value or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
