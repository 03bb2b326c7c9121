"""LLMEngine: the facade the server and run-batch use. ``step()`` schedules, runs one forward and samples."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .fast_paths import describe
from .inputs import DeviceTokens
from .interface import EngineStats
from .model_runner import ModelRunner
from .pooling import normalized_mean
from .request import (
    CompletionOutput,
    EngineRequest,
    EngineResult,
    RequestTimes,
    Task,
    TokenLogprob,
    admission_error,
    failed_result,
)
from .sampler import Sampled, Sampler, SampleRow, has_penalties, mix64
from .scheduler import ScheduledSeq, Scheduler
from .self_check import self_check
from .sequence import PENDING, RequestState, Sequence, Status
from .transfer import indices

logger = logging.getLogger(__name__)


class LLMEngine:
    tasks: frozenset[Task] = frozenset({"generate", "embed"})
    block_manager: BlockManager
    scheduler: Scheduler

    def __init__(self, model: PreTrainedModel, tokenizer: Any, config: EngineConfig, model_name: str) -> None:
        config.apply_torch_threads()
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.runner = ModelRunner(model, config)
        self.sampler = Sampler()
        self.async_scheduling = config.uses_async_scheduling(self.runner.device)
        self.reset()
        model_limit = config.max_model_len or getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if model_limit is None:
            raise ValueError("the model config names no max_position_embeddings; set max_model_len")
        self.max_context_length: int = min(model_limit, self.runner.num_blocks * config.block_size)
        self.vocab_size: int = model.config.get_text_config().vocab_size
        """Token ids a request may name (prompt, stop tokens, logit bias): rows of the embedding and of the logits."""
        self.eos_token_ids = frozenset(token for token in _eos_ids(model, tokenizer) if token < self.vocab_size)
        self._seeds = random.Random(config.seed)
        self._totals = {"prompt": 0, "cached": 0, "generated": 0}
        if config.self_check:
            self_check(self)
        logger.info("%s: fast paths: %s", model_name, describe(self.runner.paths))

    def reset(self) -> None:
        """Forget every request and start from an empty cache (the weights and the cache tensors stay): how the
        worker recovers from a step that failed in a way it could not pin on a request."""
        config = self.config
        preemptions = self.scheduler.num_preemptions if hasattr(self, "scheduler") else 0
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.scheduler.num_preemptions = preemptions  # a total since start
        self._requests: dict[str, RequestState] = {}
        self._ready: list[EngineResult] = []
        self._step: list[ScheduledSeq] | None = None
        """What the step being run holds (its requests are the suspects if it fails); ``None`` between steps and while
        scheduling."""
        self._in_flight: _Launched | None = None

    # ---- requests in and out -----------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        params = request.params
        prompt_len = len(request.prompt_token_ids)
        max_len = min(self.max_context_length, params.max_context_length or self.max_context_length)
        error = admission_error(request, max_len, self._requests, self.vocab_size)
        if error is not None:
            self._ready.append(EngineResult(request.request_id, prompt_len, error=error, group=request.group))
            return
        max_tokens = max_len - prompt_len if params.max_tokens is None else min(params.max_tokens, max_len - prompt_len)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        state = RequestState(request, max_len, max_tokens, frozenset(stop_ids), seed)
        state.seqs.append(self._new_sequence(state, list(request.prompt_token_ids), 0))
        self._requests[request.request_id] = state
        self.scheduler.add(state.seqs[0])

    def abort_request(self, request_id: str) -> bool:
        """Drop a request at once (no result is produced for it); ``False`` if it is unknown or already done."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        for seq in state.seqs:
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq)
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
        self._totals = dict.fromkeys(self._totals, 0)
        self.scheduler.num_preemptions = 0

    def stats(self) -> EngineStats:
        return EngineStats(
            queued=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            kv_blocks_total=self.block_manager.num_blocks,
            kv_blocks_free=self.block_manager.num_free_blocks,
            prompt_tokens=self._totals["prompt"],
            cached_tokens=self._totals["cached"],
            generated_tokens=self._totals["generated"],
            preemptions=self.scheduler.num_preemptions,
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
        finished, self._ready = self._ready, []
        if self._in_flight is not None and not self._in_flight.overlappable:
            self._settle(finished)
        self._step = None
        scheduled = self._step = self.scheduler.schedule()
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
        self._step = None  # it went through (and holds no finished request's state past its step)
        return finished

    def _launch(self, scheduled: list[ScheduledSeq], finished: list[EngineResult]) -> _Launched | None:
        """Start the step, and leave it in flight. If starting fails: with no step in flight, isolate the fault;
        else settle that step first, and run this one again from there, one step at a time."""
        try:
            return self._start(scheduled)
        except Exception as exc:
            if self._in_flight is None:
                self._isolate(scheduled, exc, finished)
            else:
                self._settle(finished)
                self._run(scheduled, finished)
            return None

    def _run(self, scheduled: list[ScheduledSeq], finished: list[EngineResult]) -> None:
        """With no step in flight: launch the step and settle it at once (``_launch`` isolates a fault)."""
        scheduled = [item for item in scheduled if item.seq.status is Status.RUNNING]  # not failed or ended meanwhile
        if scheduled:
            self._in_flight = self._launch(scheduled, finished)
            if self._in_flight is not None:
                self._settle(finished)

    def _isolate(self, scheduled: list[ScheduledSeq], exc: Exception, finished: list[EngineResult]) -> None:
        """After the sequences failed to compute together: compute them again in halves, down to one, so that only
        the request(s) that make it fail are failed (with a ``server_error`` result) and everyone else's step goes
        on. Starting a step changes no engine state until its forward and sampling are launched, and sampling is
        stateless, so a retried half gives exactly what the whole would have."""
        if len(scheduled) == 1:
            self._fail(scheduled[0].seq.state, exc, finished)
            return
        half = len(scheduled) // 2
        self._run(scheduled[:half], finished)
        self._run(scheduled[half:], finished)

    def _start(self, scheduled: list[ScheduledSeq]) -> _Launched:
        """Launch the forward and the sampling of a step, then advance the sequences as if it were done: their
        computed tokens count, and each sampled one holds a ``PENDING`` token until the step is settled."""
        sample_rows: list[int] = []
        logits_rows: list[int] = []
        rows: list[SampleRow] = []
        choices: list[int] = []
        device_rows: list[int] = []  # inputs the step in flight sampled: its output holds them
        device_sources: list[int] = []
        want_hidden = False
        row = 0
        for item in scheduled:
            seq = item.seq
            row += item.num_tokens
            if seq.pending and seq.num_computed_tokens + item.num_tokens == len(seq.token_ids):  # the chunk reaches it
                assert self._in_flight is not None  # only a step in flight leaves one
                device_rows.append(row - 1)
                device_sources.append(self._in_flight.token_rows[seq])
            if seq.state.request.task == "embed":
                want_hidden = True
                choices.append(0)  # nothing to sample
                continue
            if seq.num_uncomputed > item.num_tokens:
                choices.append(0)  # a prefill chunk short of the prompt's end
                continue
            sample_rows.append(row - 1)
            state = seq.state
            seeds = self._choice_seeds(seq)
            choices.append(len(seeds))
            for seed in seeds:
                logits_rows.append(len(sample_rows) - 1)
                rows.append(
                    SampleRow(
                        state.request.params, seed, len(seq), seq.token_ids, seq.num_prompt_tokens, state.stop_token_ids
                    )
                )
        device_tokens = None
        if device_rows:
            assert self._in_flight is not None and self._in_flight.sampled is not None
            device_tokens = DeviceTokens(device_rows, device_sources, self._in_flight.sampled.tokens)
        output = self.runner.forward(
            scheduled, self.block_manager.tables.array, sample_rows, want_hidden, device_tokens
        )
        sampled = None
        if rows:
            logits = output.logits
            if len(logits_rows) != len(sample_rows):  # a completed prompt feeds its n choices from one row
                logits = logits[indices(logits_rows, logits.device)]
            sampled = self.sampler.launch(logits, rows)

        launched = _Launched(scheduled, choices, output.hidden, sampled)
        bs, row = self.config.block_size, 0
        for item, n in zip(scheduled, choices, strict=True):
            seq = item.seq
            launched.first_blocks.append(seq.num_computed_tokens // bs)
            seq.num_computed_tokens += item.num_tokens
            index = len(seq.token_ids)
            launched.token_indices.append(index)
            if n:
                launched.token_rows[seq] = row  # a fork's parent holds choice 0
                row += n
                if not _ends_by_length(seq, index):  # else nothing is left to compute: it waits to be settled
                    seq.token_ids.append(PENDING)
            if n > 1 or (n and has_penalties(seq.state.request.params)) or seq.state.request.task == "embed":
                launched.overlappable = False  # the next step needs what this one gives the host first
        return launched

    def _choice_seeds(self, seq: Sequence) -> list[int]:
        """The seeds of the choices a sampled row feeds: ``n`` of them when the prompt just completed (they fork from
        it, each sampling its first token from the same logits)."""
        state = seq.state
        if seq.forked or state.request.params.n == 1:
            return [seq.seed]
        return [_choice_seed(state, index) for index in range(state.request.params.n)]

    def _settle(self, finished: list[EngineResult]) -> None:
        """Read the step in flight back (waiting for the device) and commit it."""
        launched, self._in_flight = self._in_flight, None
        assert launched is not None
        try:
            token_ids, logprobs = launched.sampled.read() if launched.sampled is not None else ([], [])
        except Exception:  # the device failed running it (not the step just scheduled): its requests are suspect
            self._step = launched.scheduled
            raise
        row = start = 0
        for item, n, first_block, index in zip(
            launched.scheduled, launched.choices, launched.first_blocks, launched.token_indices, strict=True
        ):
            choices = (
                [(token_ids[row], logprobs[row])]
                if n == 1
                else list(zip(token_ids[row : row + n], logprobs[row : row + n], strict=True))
            )
            row += n
            hidden = None if launched.hidden is None else launched.hidden[start : start + item.num_tokens]
            start += item.num_tokens
            if item.seq.status is Status.FINISHED:
                continue  # aborted, failed or ended while the step ran: what it computed is not wanted
            try:
                self._commit_one(item, first_block, index, hidden, choices, finished)
            except Exception as exc:  # e.g. a tokenizer that cannot decode the token: this request alone fails
                self._fail(item.seq.state, exc, finished)

    def _commit_one(
        self,
        item: ScheduledSeq,
        first_block: int,
        index: int,
        hidden: torch.Tensor | None,
        choices: list[tuple[int, TokenLogprob | None]],
        finished: list[EngineResult],
    ) -> None:
        """Commit one sequence's part of a step: its full blocks are published to the prefix cache, and the token at
        ``index`` (``PENDING`` until now) takes each choice's sampled token."""
        seq, state = item.seq, item.seq.state
        if choices:  # first, so that the blocks published next hold it, not the placeholder
            seq.put(index, choices[0][0])
        self.block_manager.register_full_blocks(seq, first_block)
        if state.request.task == "embed":
            assert hidden is not None
            chunk_sum = hidden.float().sum(dim=0)
            state.embedding_sum = chunk_sum if state.embedding_sum is None else state.embedding_sum + chunk_sum
            if not seq.num_uncomputed:
                self.scheduler.finish(seq)
                finished.append(self._embedding_result(state))
            return
        if not choices:
            return  # a prefill chunk that does not reach the end of the prompt yet
        if state.first_token is None:
            state.first_token = time.time()
            self._totals["prompt"] += len(state.request.prompt_token_ids)
            self._totals["cached"] += state.cached_tokens
        targets = self._fork(seq, index) if len(choices) > 1 else [seq]
        ended = False
        for target, (token_id, logprob) in zip(targets, choices, strict=True):
            ended |= self._set_token(target, index, token_id, logprob)
        if ended and state.finished and state.request.request_id in self._requests:
            finished.append(self._completion_result(state))
        elif state.request.stream:
            finished.append(self._partial_result(state, targets))

    def _fail(self, state: RequestState, exc: Exception, finished: list[EngineResult]) -> None:
        """Fail one request whose step raised; the engine carries on with the others."""
        for seq in state.seqs:
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq)
        self._requests.pop(state.request.request_id, None)
        finished.append(failed_result(state.request, exc))

    def _new_sequence(self, state: RequestState, token_ids: list[int], index: int) -> Sequence:
        params = state.request.params
        detokenizer = None
        if params.stop or state.request.stream:
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        logprobs: list[TokenLogprob] | None = [] if params.logprobs else None
        return Sequence(
            state,
            token_ids,
            len(state.request.prompt_token_ids),
            index,
            _choice_seed(state, index),
            detokenizer,
            logprobs=logprobs,
        )

    def _fork(self, parent: Sequence, index: int) -> list[Sequence]:
        """Make the other n-1 choices share the prompt's KV blocks now that the prompt is computed; return all n.
        Each holds the tokens before ``index``, where its first sampled token goes."""
        parent.forked = True
        state = parent.state
        for choice in range(1, state.request.params.n):
            child = self._new_sequence(state, parent.token_ids[:index], choice)
            child.forked = True
            state.seqs.append(child)
            if self.block_manager.fork(parent, child, self.runner.copy_block):
                child.status = Status.RUNNING
                self.scheduler.running.append(child)
            else:  # no block free to copy into: the child recomputes its prompt (mostly from the prefix cache)
                self.scheduler.add(child)
        return state.seqs

    def _set_token(self, seq: Sequence, index: int, token_id: int, logprob: TokenLogprob | None) -> bool:
        """Put a sampled token at ``index``; end the sequence if it ends there, and say so."""
        seq.put(index, token_id)
        self._totals["generated"] += 1
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append(logprob)
        state = seq.state
        # vLLM's rule: nothing stops a sequence shorter than min_tokens (the sampler bans its stop tokens until then).
        may_stop = index + 1 - seq.num_prompt_tokens >= state.request.params.min_tokens
        if (may_stop and token_id in state.stop_token_ids) or (
            seq.detokenizer is not None and seq.detokenizer.add(token_id, find_stops=may_stop)
        ):
            seq.finish_reason = "stop"
        elif _ends_by_length(seq, index):
            seq.finish_reason = "length"
        if seq.finish_reason is None:
            return False
        self.scheduler.finish(seq)  # a pending token after ``index`` (sampled for nothing) is never reported
        return True

    def _completion_result(self, state: RequestState) -> EngineResult:
        del self._requests[state.request.request_id]
        outputs = [
            CompletionOutput(seq.index, seq.generated_ids, self._text(seq), seq.finish_reason or "length", seq.logprobs)
            for seq in state.seqs
        ]
        return EngineResult(
            state.request.request_id,
            len(state.request.prompt_token_ids),
            cached_tokens=state.cached_tokens,
            outputs=outputs,
            group=state.request.group,
            times=_times(state),
        )

    def _text(self, seq: Sequence) -> str:
        """A finished choice's text."""
        state = seq.state
        by_stop_token = seq.finish_reason == "stop" and seq.generated_ids[-1] in state.stop_token_ids
        if seq.detokenizer is None:  # the stop token is not part of the text (it never reaches a detokenizer)
            ids = seq.generated_ids[:-1] if by_stop_token else seq.generated_ids
            return str(self.tokenizer.decode(ids, skip_special_tokens=state.request.params.skip_special_tokens))
        if seq.finish_reason == "stop" and not by_stop_token:
            return seq.detokenizer.text  # cut before the stop string
        return seq.detokenizer.finish()

    def _partial_result(self, state: RequestState, seqs: list[Sequence]) -> EngineResult:
        """What a streamed request's choices ``seqs`` added this step. Text that could still turn out to be the start
        of a stop string is held back (the stop search looks that far back), so what is reported is always a prefix
        of the final text."""
        outputs = []
        for seq in seqs:
            assert seq.detokenizer is not None  # every sequence of a streamed request has one
            if seq.finish_reason is None:
                text = seq.detokenizer.text
                end = max(seq.streamed_chars, len(text) - max(0, seq.detokenizer.max_stop_len - 1))
            else:
                text = self._text(seq)
                end = len(text)
            logprobs = None if seq.logprobs is None else seq.logprobs[seq.streamed_tokens :]
            tokens = seq.generated_ids[seq.streamed_tokens :]
            outputs.append(
                CompletionOutput(seq.index, tokens, text[seq.streamed_chars : end], seq.finish_reason, logprobs)
            )
            seq.streamed_tokens, seq.streamed_chars = seq.num_generated, end
        request = state.request
        return EngineResult(
            request.request_id,
            len(request.prompt_token_ids),
            cached_tokens=state.cached_tokens,
            outputs=outputs,
            group=request.group,
            finished=False,
        )

    def _embedding_result(self, state: RequestState) -> EngineResult:
        del self._requests[state.request.request_id]
        assert state.embedding_sum is not None
        embedding = normalized_mean(state.embedding_sum, len(state.request.prompt_token_ids)).tolist()
        self._totals["prompt"] += len(state.request.prompt_token_ids)
        return EngineResult(
            state.request.request_id,
            len(state.request.prompt_token_ids),
            embedding=embedding,
            group=state.request.group,
            times=_times(state),
        )


@dataclass(slots=True)
class _Launched:
    """A step whose forward and sampling are launched, not yet settled (read back and committed)."""

    scheduled: list[ScheduledSeq]
    choices: list[int]
    """Tokens sampled for each scheduled sequence: 0 (a prefill chunk short of the prompt's end, an embedding), 1,
    or ``n`` when the prompt just completed (its choices fork from it)."""
    hidden: torch.Tensor | None
    sampled: Sampled | None
    overlappable: bool = True
    """Whether the next step may be scheduled and launched before this one is settled (with async scheduling)."""
    first_blocks: list[int] = field(default_factory=list)
    """Each sequence's first block not full before the step: where publishing full blocks resumes."""
    token_indices: list[int] = field(default_factory=list)
    """Each sequence's index of the token the step samples (``PENDING`` there until settled)."""
    token_rows: dict[Sequence, int] = field(default_factory=dict)
    """Row of ``sampled.tokens`` each sampled sequence takes its next input from."""


def _ends_by_length(seq: Sequence, index: int) -> bool:
    """Whether the token at ``index`` is the sequence's last by ``max_tokens`` or the context cap."""
    state = seq.state
    return index + 1 - seq.num_prompt_tokens >= state.max_tokens or index + 1 >= state.max_len


def _times(state: RequestState) -> RequestTimes:
    return RequestTimes(state.arrival, state.scheduled or state.arrival, state.first_token, time.time())


def _request_ids(seqs: Iterable[Sequence]) -> list[str]:
    return list(dict.fromkeys(seq.state.request.request_id for seq in seqs))


def _choice_seed(state: RequestState, index: int) -> int:
    return mix64(state.seed, index)


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
