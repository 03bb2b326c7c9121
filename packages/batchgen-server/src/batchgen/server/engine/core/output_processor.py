"""A settled step's outputs: each sequence's sampled token committed, stop conditions checked, text detokenized,
the ``n`` choices forked when a prompt completes, and the results made: final ones, and partial ones for streamed
requests. Also the totals the engine's stats count."""

from __future__ import annotations

import time
from typing import Any

import torch

from ..features.pooling import Pooler
from ..request import (
    MAX_REASON_CHARS,
    CompletionOutput,
    EngineResult,
    GrammarError,
    RequestTimes,
    TokenLogprob,
    failed_result,
)
from ..runner.launched import Launched
from ..scheduler_output import ScheduledSeq
from ..sequence import RequestState, Sequence, Status
from .scheduler import Scheduler


class OutputProcessor:
    def __init__(self, tokenizer: Any, scheduler: Scheduler, requests: dict[str, RequestState], pooler: Pooler) -> None:
        self.tokenizer = tokenizer
        self.pooler = pooler
        """What an ``embed`` request's prompt is pooled into."""
        self.scheduler = scheduler
        self.requests = requests
        """The engine's requests by id: a finished one leaves it."""
        self.totals = {"prompt": 0, "cached": 0, "generated": 0}

    def commit(
        self,
        launched: Launched,
        token_ids: list[int],
        logprobs: list[Any],
        prompt: list[list[TokenLogprob]],
        finished: list[EngineResult],
    ) -> None:
        """Commit every sequence's part of a settled step (``prompt``: the logprobs of ``launched.prompt``'s spans);
        a request whose commit raises fails alone."""
        if launched.prompt is not None:  # first: a request that ends in this step reports them
            for span, values in zip(launched.prompt.spans, prompt, strict=True):
                if span.seq.state.prompt_logprobs is not None:  # a recompute (preemption) writes the same values
                    span.seq.state.prompt_logprobs[span.first : span.first + span.count] = values
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
                self.fail(item.seq.state, exc, finished)

    def fail(self, state: RequestState, exc: Exception, finished: list[EngineResult]) -> None:
        """Fail one request whose step raised; the engine carries on with the others."""
        for seq in state.seqs:
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq)
        self.requests.pop(state.request.request_id, None)
        finished.append(failed_result(state.request, exc))

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
        self.scheduler.block_manager.register_full_blocks(seq, first_block)
        if state.request.task == "embed":
            assert hidden is not None
            state.pooled = self.pooler.add(state.pooled, hidden, seq.num_computed_tokens - item.num_tokens)
            if not seq.num_uncomputed:
                self.scheduler.finish(seq)
                finished.append(self._embedding_result(state))
            return
        if not choices:
            return  # a prefill chunk that does not reach the end of the prompt yet
        if state.first_token is None:
            state.first_token = time.time()
            self.totals["prompt"] += len(state.request.prompt_token_ids)
            self.totals["cached"] += state.cached_tokens
        targets = [seq]
        if len(choices) > 1:  # the prompt is computed: the other choices share its blocks from now on
            seq.forked = True
            children = [state.new_sequence(seq.token_ids[:index], i, self.tokenizer) for i in range(1, len(choices))]
            for child in children:  # each choice follows the grammar from where the parent is, on its own
                child.forked = True
                child.grammar_active = seq.grammar_active
                child.matcher = None if seq.matcher is None else seq.matcher.deep_copy()
            state.seqs += children
            self.scheduler.fork(seq, children)
            targets = state.seqs
        ended = False
        for target, (token_id, logprob) in zip(targets, choices, strict=True):
            ended |= self._set_token(target, index, token_id, logprob)
        if ended and state.finished and state.request.request_id in self.requests:
            finished.append(self._completion_result(state))
        elif state.request.stream:
            finished.append(self._partial_result(state, targets))

    def _set_token(self, seq: Sequence, index: int, token_id: int, logprob: TokenLogprob | None) -> bool:
        """Put a sampled token at ``index`` (its grammar advanced by it); end the sequence if it ends there (a
        grammar that allows nothing more ends it too), and say so."""
        seq.put(index, token_id)
        self.totals["generated"] += 1
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append(logprob)
        grammar_done = seq.matcher is not None and self._advance_grammar(seq, index)
        state = seq.state
        # vLLM's rule: nothing stops a sequence shorter than min_tokens (the sampler bans its stop tokens until then).
        may_stop = index + 1 - seq.num_prompt_tokens >= state.request.params.min_tokens
        if (may_stop and token_id in state.stop_token_ids) or (
            seq.detokenizer is not None and seq.detokenizer.add(token_id, find_stops=may_stop)
        ):
            seq.finish_reason = "stop"
        elif seq.last_by_length(index):
            seq.finish_reason = "length"
        elif grammar_done:
            seq.finish_reason = "stop"
        if seq.finish_reason is None:
            return False
        self.scheduler.finish(seq)  # a pending token after ``index`` (sampled for nothing) is never reported
        return True

    def _advance_grammar(self, seq: Sequence, index: int) -> bool:
        """The committed token through the sequence's grammar, or, while a reasoning model thinks, whether it just
        stopped (then the grammar constrains what follows); whether the grammar allows nothing more."""
        if not seq.grammar_active:
            after = seq.state.request.params.grammar_after
            if seq.token_ids[index + 1 - len(after) : index + 1] == list(after):
                seq.grammar_active = True  # the next step's inputs constrain its next token
            return False
        if not seq.matcher.consume_token(seq.token_ids[index]):  # a parser limit, past the compiled grammar's checks
            raise GrammarError(seq.matcher.get_error().split("\n", 1)[0][:MAX_REASON_CHARS])
        return bool(seq.matcher.is_stopped())

    def _completion_result(self, state: RequestState) -> EngineResult:
        del self.requests[state.request.request_id]
        outputs = [
            CompletionOutput(seq.index, seq.generated_ids, self._text(seq), seq.finish_reason or "length", seq.logprobs)
            for seq in state.seqs
        ]
        return EngineResult(
            state.request.request_id,
            len(state.request.prompt_token_ids),
            cached_tokens=state.cached_tokens,
            outputs=outputs,
            times=_times(state),
            prompt_logprobs=state.prompt_logprobs,
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
            finished=False,
        )

    def _embedding_result(self, state: RequestState) -> EngineResult:
        del self.requests[state.request.request_id]
        assert state.pooled is not None
        embedding = self.pooler.result(state.pooled, len(state.request.prompt_token_ids))
        self.totals["prompt"] += len(state.request.prompt_token_ids)
        self.totals["cached"] += state.cached_tokens
        return EngineResult(
            state.request.request_id,
            len(state.request.prompt_token_ids),
            cached_tokens=state.cached_tokens,
            embedding=embedding,
            times=_times(state),
        )


def _times(state: RequestState) -> RequestTimes:
    return RequestTimes(state.arrival, state.scheduled or state.arrival, state.first_token, time.time())
