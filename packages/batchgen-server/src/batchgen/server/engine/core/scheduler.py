"""Choose what each step computes: a token budget shared by decodes and chunked prefills.

Policy: sequences already running go first (a decode needs one token, an unfinished prefill continues with the
next chunk), then waiting sequences are admitted strictly first come, first served (so batches are served in the
order they arrived) while the budget, the running-sequence cap and free KV blocks allow. When a running sequence
needs a block and none is free, the most recently admitted sequence is preempted: its blocks are freed (full ones
stay in the prefix cache) and it goes back to the front of the queue, to be recomputed later.

Twins: a batch line whose prefix hit would stop at a block that a running sequence is computing (lines repeating a
prompt, or under one system prompt, admitted together) is not admitted while that block is computed: it keeps its
place and the lines behind it are admitted meanwhile, and once the block is published it is admitted first, as a
prefix hit (``twins.py``). The prefix is computed once, not once per line.

Interactive sequences (online requests) come first everywhere: they wait ahead of batch ones, run first in a step,
and when one cannot be admitted (the running set is full, or no block is free) the batch sequence admitted last is
preempted to make room. A batch never makes an online request wait behind it. And a step that carries online
requests' decodes takes only so many prefill tokens (``StepCosts.prefill_budget``: the step costs at most about
``--max-mixed-step-ratio`` times a step of decodes alone), so that a prompt arriving beside streams delays their
next token by a bounded factor; the rest of it continues in the next steps (an online prompt's in 4 at most,
``MAX_SPREAD``). Steps without them (a batch, prompts alone) take prefills up to the whole budget, as do steps
where online prompts are at least half as many as the streams (a burst) and steps while batch prompts are computed
or wait (the batch's throughput is not traded for the streams' smoothness).

The scheduler decides; it owns every change of a sequence's place: admission, the tokens computed as steps run,
preemption and finishing, the forks of ``n`` choices, and what a running sequence holds: its KV blocks (and the cache
group beside them: the block manager's), and its seats (``Seats``: a resource a running sequence holds, such as an
adapter's slot on the device). Each step it reports what runs and which sequences started or stopped running
(``SchedulerOutput``); the model runner turns that into the step's inputs. It knows the features a request may
carry by what they ask of a step alone: where a prompt's chunk may end (``EngineRequest.chunk_tokens``), whether its
prompt may start from cached blocks (``RequestState.reads_prefix_cache``), and its seats.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container
from collections.abc import Sequence as Seq
from itertools import takewhile
from typing import Protocol

from ..scheduler_output import ScheduledSeq, SchedulerOutput
from ..sequence import PENDING, Sequence, Status
from .block_manager import BlockManager
from .step_costs import StepCosts


class Seats(Protocol):
    """A resource the scheduler hands out as it does KV blocks: a running sequence holds a seat, and one that finds
    none it can take waits."""

    def can_take(self, seq: Sequence) -> bool: ...
    def take(self, seq: Sequence) -> None: ...
    def give_back(self, seq: Sequence) -> None: ...
    def reset(self) -> None: ...


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        copy_block: Callable[[int, int], None],
        seats: Seq[Seats] = (),
        step_costs: StepCosts | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._copy_block = copy_block
        """Copies a cache block's contents (a fork's partly filled last block)."""
        self.seats = seats
        """What a running sequence holds besides its blocks: it runs once it can take one of each."""
        self.step_costs = step_costs
        """What bounds the prefill tokens of a step that carries online requests' decodes (``None``: nothing)."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        """A total since start, across resets."""
        self._started: list[Sequence] = []
        self._stopped: list[Sequence] = []
        """The sequences that started and stopped running since the last report (``schedule``, ``changes``)."""

    def reset(self, block_manager: BlockManager) -> None:
        """Forget every sequence, on a fresh cache (how the engine recovers from a failed step)."""
        self.block_manager = block_manager
        for seats in self.seats:
            seats.reset()
        self.waiting.clear()
        self.running = []
        self._started, self._stopped = [], []

    def add(self, seq: Sequence) -> None:
        self._enqueue(seq, front=False)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        kept: list[Sequence] = []
        # Interactive first (a stable sort keeps admission order within each kind), so ``queue.pop()`` preempts batch.
        interactive = any(map(_is_interactive, self.running))
        queue = deque(sorted(self.running, key=_is_batch) if interactive else self.running)
        prefill = self._prefill_budget(budget) if interactive else budget
        """Prefill tokens (chunks of more than one token) the step may still take (below 0 once an image's chunk,
        which cannot end inside the image, ran past it)."""
        reserved = sum(seq.num_uncomputed for seq in takewhile(_is_interactive, self.waiting))
        """Prefill tokens the online prompts waiting would take: a batch prompt running does not take them first."""
        while queue and budget > 0:
            seq = queue.popleft()
            left = len(seq.token_ids) - seq.num_computed_tokens  # (``num_uncomputed``, read once: a hot loop)
            chunk = left > 1
            if chunk:  # (a batch prompt computing means no bound: ``_prefill_budget``; decodes are most of a hot loop)
                allowed = budget - reserved if _is_batch(seq) else _allowance(seq, prefill)
            if not left or (chunk and allowed <= 0):
                kept.append(seq)  # its last token is being sampled (it waits to be read), or a prompt past the bound
                continue
            num_tokens = _chunk(seq, min(left, budget, allowed)) if chunk else 1
            if self.block_manager.blocks_needed(seq, num_tokens):  # else a decode within its last block: common
                while not self.block_manager.can_allocate(seq, num_tokens) and queue:
                    self._preempt(queue.pop())
                if not self.block_manager.can_allocate(seq, num_tokens):
                    self._preempt(seq)
                    break
                self.block_manager.allocate(seq, num_tokens)
            scheduled.append(ScheduledSeq(seq, num_tokens))
            kept.append(seq)
            budget -= num_tokens
            if chunk:
                prefill -= num_tokens
        kept.extend(queue)  # not reached this step (budget spent): they keep their blocks and run next step
        self.running = kept

        place = 0
        """The place in the queue of the next sequence to admit: those before it wait for a twin's blocks."""
        while place < len(self.waiting) and budget > 0 and _allowance(self.waiting[place], prefill) > 0:
            seq = self.waiting[place]
            if len(self.running) >= self.max_num_seqs:
                if not _is_interactive(seq) or (refund := self._preempt_batch(scheduled)) is None:
                    break
                budget, prefill = budget + refund[0], prefill + refund[1]
            if not all(seats.can_take(seq) for seats in self.seats):
                break  # it waits for a seat to be given back
            reads_cache = seq.state.reads_prefix_cache(seq)
            if reads_cache and _is_batch(seq) and self.block_manager.twin(seq) is not None:
                place += 1  # it waits for the blocks another computes, in its place; those behind it may run
                if place >= self.max_num_seqs:
                    break  # (a bound on this step's look at a long queue of lines under one prompt)
                continue
            cached = self.block_manager.match_prefix(seq) if reads_cache else 0
            num_tokens = _chunk(seq, min(seq.num_uncomputed, budget, _allowance(seq, prefill)))
            while not self.block_manager.can_allocate(seq, num_tokens):
                if not _is_interactive(seq) or (refund := self._preempt_batch(scheduled)) is None:
                    break
                budget, prefill = budget + refund[0], prefill + refund[1]
                num_tokens = _chunk(seq, min(seq.num_uncomputed, budget, _allowance(seq, prefill)))
            if not self.block_manager.can_allocate(seq, num_tokens):
                self.block_manager.free_seq(seq)  # a waiting sequence holds no blocks
                break
            if len(seq) == seq.num_prompt_tokens and not seq.forked:  # its first admission
                seq.state.cached_tokens = cached
            del self.waiting[place]
            self.block_manager.allocate(seq, num_tokens)
            self.block_manager.claim(seq)
            self._run(seq)
            scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens
            prefill -= num_tokens
        return self._output(scheduled)

    def _prefill_budget(self, budget: int) -> int:
        """The prefill tokens a step may take while online requests run: bounded where they decode, unless the online
        prompts waiting (or part computed) are at least half as many as the streams: a burst, whose first tokens are
        worth one stall to the streams (the bound would spread it over dozens of steps, each a stall, and the last of
        the burst's first tokens would come seconds later: 1.4 s against 0.45 for the first 16 of a served run); or
        unless batch prompts are computed or wait: the step is the batch's, whose throughput is not traded for the
        streams' smoothness (bounded beside one stream, a batch of 512-token prompts took 2.5x its time)."""
        if self.step_costs is None or not self.step_costs.bounds or (self.waiting and _is_batch(self.waiting[-1])):
            return budget  # (off or not measured yet; or batch lines wait: they wait last)
        decodes = streams = prompts = 0
        for seq in self.running:
            left = len(seq.token_ids) - seq.num_computed_tokens  # (``num_uncomputed``, read once: a hot loop)
            if left == 1:
                decodes += 1
                streams += _is_interactive(seq)
            elif left > 1:
                if _is_batch(seq):
                    return budget
                prompts += 1
        if not streams:
            return budget
        prompts += len(self.waiting)  # (online ones only: no batch line waits)
        if 2 * prompts >= streams:
            return budget
        bound = self.step_costs.prefill_budget(decodes, min(self.max_num_seqs, len(self.running) + len(self.waiting)))
        return budget if bound is None else min(bound, budget)

    def changes(self) -> SchedulerOutput:
        """The sequences that started and stopped running since the last report, with nothing scheduled: the engine
        hands them to the runner at once after a step or an abort, so that nothing of a finished request stays."""
        return self._output([])

    def _output(self, scheduled: list[ScheduledSeq]) -> SchedulerOutput:
        started, stopped, self._started, self._stopped = self._started, self._stopped, [], []
        return SchedulerOutput(scheduled, started, stopped)

    def advance(self, scheduled: list[ScheduledSeq], sampled: Container[Sequence]) -> None:
        """The step ``scheduled`` is launched: its tokens count as computed (their K/V are being written), and each
        ``sampled`` sequence holds a ``PENDING`` token at its end until the step is settled (unless the token is its
        last by length: then nothing is left to compute, and it only waits to be settled)."""
        for item in scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_tokens
            if seq in sampled and not seq.last_by_length(len(seq.token_ids)):
                seq.token_ids.append(PENDING)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """The other choices of ``parent``'s request, now that its prompt is computed: each shares the prompt's blocks
        and runs at once, or (no block free for the copy of the last one) waits to recompute it, mostly from the
        prefix cache."""
        for child in children:
            if self.block_manager.fork(parent, child, self._copy_block):
                self._run(child)
            else:
                self.add(child)

    def _run(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        for seats in self.seats:
            seats.take(seq)
        self.running.append(seq)
        self._started.append(seq)

    def _leave(self, seq: Sequence) -> None:
        """Give back what ``seq`` holds: its blocks, and while it runs its seats."""
        self.block_manager.free_seq(seq)
        if seq.status is Status.RUNNING:
            for seats in self.seats:
                seats.give_back(seq)
            self._stopped.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._leave(seq)
        seq.state.pooled = None  # an embedding is pooled again over the recomputed prompt
        seq.status = Status.WAITING
        self._enqueue(seq, front=True)
        self.num_preemptions += 1

    def _preempt_batch(self, scheduled: list[ScheduledSeq]) -> tuple[int, int] | None:
        """Preempt the batch sequence admitted last, for an interactive one; the step's tokens it gives back (it may
        have been scheduled already), and of them its prefill tokens (a decode's one token is not), or ``None`` when
        no batch sequence runs."""
        victim = next((seq for seq in reversed(self.running) if _is_batch(seq)), None)
        if victim is None:
            return None
        self.running.remove(victim)
        refund = 0
        for index, item in enumerate(scheduled):
            if item.seq is victim:
                refund = item.num_tokens
                del scheduled[index]
                break
        self._preempt(victim)
        return refund, refund if refund > 1 else 0

    def _enqueue(self, seq: Sequence, *, front: bool) -> None:
        """Interactive sequences wait ahead of batch ones; within each kind first come, first served, except that a
        preempted sequence (``front``) goes first. The only way into ``waiting``: a step reads the online prompts
        waiting as its head, and whether batch lines wait from its tail."""
        if not front and _is_batch(seq):
            self.waiting.append(seq)
            return
        interactive = next((i for i, other in enumerate(self.waiting) if _is_batch(other)), len(self.waiting))
        self.waiting.insert(0 if front and _is_interactive(seq) else interactive, seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence wherever it is."""
        self._leave(seq)
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)


MAX_SPREAD = 4
"""An online prompt is computed in this many steps at most, whatever the bound beside streams: spread further it
spares them little and its first token comes a step later each time (three prompts left over from a burst, beside 13
new streams, took 0.5-1 s to their first tokens)."""


def _allowance(seq: Sequence, prefill: int) -> int:
    """The prefill tokens ``seq`` may take of a step with ``prefill`` left: an online prompt its share at least."""
    return prefill if _is_batch(seq) else max(prefill, -(-len(seq.token_ids) // MAX_SPREAD))


def _is_interactive(seq: Sequence) -> bool:
    return seq.state.request.interactive


def _is_batch(seq: Sequence) -> bool:
    return not seq.state.request.interactive


def _chunk(seq: Sequence, num_tokens: int) -> int:
    """``num_tokens`` of ``seq``, or fewer where its request says a prefill chunk may not end there."""
    return seq.state.request.chunk_tokens(seq.num_computed_tokens, num_tokens)
