"""A step's inputs, prepared in one walk over its scheduled sequences (vLLM v1's ``_prepare_inputs``): the packed row
of token ids, positions and cache slots the forward reads, the rows it keeps logits for, what the sampler reads for
them (from the batch state), and the record the step is settled from.

The packed row is written into one host array allocated once (numpy views, no Python lists of every token) and
reaches the device in one transfer, which does not block the host on CUDA (``to_device``). An input token the
previous step sampled and the host has not read yet (``PENDING``) is taken from that step's output where it is, on
the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..attention import SeqSlice
from ..attention.step import StateLayers
from ..ops.transfer import indices, to_device
from ..sampling.batch_state import BatchState, SamplingInputs
from ..sampling.prompt_logprobs import PromptSpan, prompt_rows
from ..scheduler_output import ScheduledSeq
from ..sequence import PENDING, Sequence
from .launched import Launched


@dataclass(frozen=True, slots=True)
class DeviceTokens:
    """Input tokens still on the device: packed row ``rows[i]`` takes ``tokens[sources[i]]``."""

    rows: list[int]
    sources: list[int]
    tokens: torch.Tensor


@dataclass(frozen=True, slots=True)
class PackedInputs:
    input_ids: torch.Tensor
    """``[tokens]`` on the device, as are the two below."""
    positions: torch.Tensor
    slots: torch.Tensor
    """Cache slot of each token: ``block * block_size + offset``."""
    seqs: list[SeqSlice]
    block_tables: np.ndarray
    """The rows the ``seqs`` name (``block_tables.py``)."""
    states: StateLayers | None = None
    """What the state layers run in the step (models with state layers: ``state/runtime.py``)."""

    @property
    def all_decodes(self) -> bool:
        return all(seq.num_tokens == 1 for seq in self.seqs)


@dataclass(slots=True)
class StepInputs:
    packed: PackedInputs
    sample_rows: list[int]
    """Packed rows whose logits the forward keeps, in order: those sampled (a prompt's last token, each decode), and
    those that score a prompt token (``prompt_logprobs.py``)."""
    logits_rows: list[int]
    """For each sampled logits row, its index in ``sample_rows`` (a completed prompt feeds its ``n`` choices)."""
    direct: bool
    """Whether ``logits_rows`` is every kept row once, in order (no prompt rows, no forks): no gather needed."""
    prompt_index: list[int]
    """The indices in ``sample_rows`` of the rows that score prompt tokens, in the order of ``spans``."""
    spans: list[PromptSpan]
    sampling: SamplingInputs | None
    """What the sampler reads for the logits rows; ``None`` when the step samples nothing."""
    constrained: list[int]
    """The logits rows a grammar constrains; ``owners`` gives each one's index in ``matchers`` (a prompt's ``n``
    choices share its matcher's mask in the step it completes)."""
    owners: list[int]
    matchers: list[Any]
    adapter_slots: list[int]
    """Each packed token's LoRA slot (``lora.py``)."""
    from_device: DeviceTokens | None
    """The input tokens taken from the step in flight's output."""
    want_hidden: bool
    """Whether an embedding runs: the forward keeps the last hidden state."""
    launched: Launched


class InputBuffers:
    def __init__(self, capacity: int, block_size: int, device: torch.device) -> None:
        self._host = np.zeros((3, capacity), dtype=np.int64)
        self.block_size = block_size
        self.device = device

    def prepare(
        self,
        scheduled: list[ScheduledSeq],
        block_tables: np.ndarray,
        batch: BatchState,
        previous: Launched | None = None,
        slot_of: Callable[[Sequence], int] | None = None,
    ) -> StepInputs:
        """The step's inputs; its sequences' blocks are rows of ``block_tables`` (``block_tables.py``), their sampling
        state rows of ``batch``; ``previous`` is the step in flight, whose sampled tokens the host has not read;
        ``slot_of``: each sequence's LoRA slot, with LoRA on (its tokens' rows of ``adapter_slots``)."""
        host = self._host
        ids, positions, slots = host
        bs = self.block_size
        seqs: list[SeqSlice] = []
        adapter_slots: list[int] = []
        sample_rows: list[int] = []
        logits_rows: list[int] = []
        batch_rows: list[int] = []
        sample_positions: list[int] = []
        fork_seeds: dict[int, int] = {}
        device_rows: list[int] = []
        device_sources: list[int] = []
        prompt_index: list[int] = []
        spans: list[PromptSpan] = []
        constrained: list[int] = []
        owners: list[int] = []
        matchers: list[Any] = []
        penalised: list[Sequence] = []
        launched = Launched(scheduled)
        choices, first_blocks, token_indices, token_rows = (
            launched.choices, launched.first_blocks, launched.token_indices, launched.token_rows
        )  # fmt: skip
        want_hidden = False
        row = 0
        capacity = host.shape[1]
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            end = start + n
            token_ids = seq.token_ids
            length = len(token_ids)
            if row + n > capacity:
                host = self._grow(row + n, row)
                ids, positions, slots = host
                capacity = host.shape[1]
            if start + 1 < seq.num_prompt_tokens and (scored := prompt_rows(seq, start, n)):  # before the sampled row
                spans.append(PromptSpan(seq, start + 1, scored))
                prompt_index += range(len(sample_rows), len(sample_rows) + scored)
                sample_rows += range(row, row + scored)
            mm = seq.state.request.multimodal if n > 1 else None
            seqs.append(SeqSlice(row, n, start, seq.table_row, mm.spans_in(start, end) if mm is not None else ()))
            first_blocks.append(start // bs)
            token_indices.append(length)
            if n == 1:  # a decode: scalars are cheaper than numpy calls (and the list than the array)
                ids[row] = token_ids[start]
                positions[row] = start
                slots[row] = seq.block_table[start // bs] * bs + start % bs
            else:
                span = np.arange(start, end)
                ids[row : row + n] = token_ids[start:end]
                positions[row : row + n] = span
                slots[row : row + n] = block_tables[seq.table_row, span // bs] * bs + span % bs
            if slot_of is not None:
                adapter_slots += [slot_of(seq)] * n
            row += n
            if end == length and token_ids[-1] == PENDING:  # the step in flight samples it
                assert previous is not None
                device_rows.append(row - 1)
                device_sources.append(previous.token_rows[seq])
            request = seq.state.request
            if end < length or request.task == "embed":
                choices.append(0)  # nothing to sample: a prefill chunk short of its end, or an embedding
                if request.task == "embed":
                    want_hidden = True
                    launched.overlappable = False
                continue
            params = request.params
            first = len(batch_rows)
            token_rows[seq] = first  # a fork's parent holds choice 0
            logits_rows.append(len(sample_rows))
            sample_rows.append(row - 1)
            batch_rows.append(seq.row)
            sample_positions.append(length)
            choices_n = 1 if seq.forked else params.n
            for choice in range(1, choices_n):  # a completed prompt's other choices each sample their first token
                fork_seeds[len(batch_rows)] = seq.state.choice_seed(choice)  # the row's own seed is choice 0's
                logits_rows.append(logits_rows[-1])
                batch_rows.append(seq.row)
                sample_positions.append(length)
            choices.append(choices_n)
            if choices_n > 1 or params.penalised or seq.matcher is not None:
                launched.overlappable = False  # the next step needs what this one gives the host first
                if params.penalised:
                    penalised.append(seq)
                if seq.matcher is not None and seq.grammar_active:
                    constrained += range(first, first + choices_n)
                    owners += [len(matchers)] * choices_n
                    matchers.append(seq.matcher)
        if penalised:  # their counts catch up with the tokens committed since their last step
            batch.count_generated(penalised)
        sampling = batch.inputs(batch_rows, sample_positions, fork_seeds) if batch_rows else None
        # Contiguous, so that pinning and a non-blocking copy need no pageable staging copy first.
        packed = to_device(torch.from_numpy(np.ascontiguousarray(host[:, :row])), self.device)
        from_device = None
        if device_rows:
            assert previous is not None and previous.sampled is not None
            from_device = DeviceTokens(device_rows, device_sources, previous.sampled.tokens)
            chosen = from_device.tokens[indices(device_sources, self.device)]
            packed[0].index_copy_(0, indices(device_rows, self.device), chosen)
        inputs = PackedInputs(packed[0], packed[1], packed[2], seqs, block_tables)
        direct = not spans and len(logits_rows) == len(sample_rows)
        return StepInputs(
            inputs, sample_rows, logits_rows, direct, prompt_index, spans, sampling, constrained, owners, matchers,
            adapter_slots, from_device, want_hidden, launched,
        )  # fmt: skip

    def _grow(self, needed: int, kept: int) -> np.ndarray:
        """Room for ``needed`` tokens, the first ``kept`` written already."""
        host = np.zeros((3, max(needed, 2 * self._host.shape[1])), dtype=np.int64)
        host[:, :kept] = self._host[:, :kept]
        self._host = host
        return host
