"""The packed inputs, written into preallocated buffers, equal those built token by token from Python lists; the same
walk names the rows sampled."""

from __future__ import annotations

import random

import torch

from batchgen.server.engine.attention import SeqSlice
from batchgen.server.engine.core.block_tables import BlockTables
from batchgen.server.engine.request import EngineRequest
from batchgen.server.engine.runner.inputs import InputBuffers
from batchgen.server.engine.sampling.batch_state import BatchState
from batchgen.server.engine.scheduler_output import ScheduledSeq
from batchgen.server.engine.sequence import RequestState, Sequence

BLOCK = 4


def _scheduled(seed: int, tables: BlockTables, batch: BatchState) -> list[ScheduledSeq]:
    """Decodes, prefills from 0 and chunks continuing a cached context, over shuffled block tables; each with its
    row of the batch state."""
    rng = random.Random(seed)
    free = list(range(200))
    rng.shuffle(free)
    scheduled = []
    for i, (computed, new) in enumerate([(9, 1), (0, 7), (12, 6), (0, 1), (23, 1), (4, 11), (30, 1), (16, 3)]):
        tokens = [rng.randrange(1000) for _ in range(computed + new)]
        state = RequestState(EngineRequest(f"r{i}", tokens), 100, 10, frozenset(), 0)
        seq = Sequence(state, tokens, len(tokens))
        seq.num_computed_tokens = computed
        for _ in range(-(-(computed + new) // BLOCK)):
            tables.append(seq, free.pop())
        seq.row = batch.add_row(state.request.params, 0, tokens, [])
        scheduled.append(ScheduledSeq(seq, new))
    return scheduled


def _reference(scheduled: list[ScheduledSeq]) -> tuple[list[int], list[int], list[int], list[SeqSlice]]:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seqs = []
    for item in scheduled:
        seq, n, start = item.seq, item.num_tokens, item.seq.num_computed_tokens
        seqs.append(SeqSlice(len(ids), n, start, seq.table_row))
        ids.extend(seq.token_ids[start : start + n])
        positions.extend(range(start, start + n))
        slots.extend(seq.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n))
    return ids, positions, slots, seqs


def test_packed_inputs_equal_the_list_built_ones() -> None:
    buffers = InputBuffers(capacity=8, block_size=BLOCK, device=torch.device("cpu"))  # grows when a step needs more
    tables = BlockTables(rows=2, columns=2)  # grows too, keeping every table
    batch = BatchState(1000, torch.device("cpu"))
    for seed in range(3):
        scheduled = _scheduled(seed, tables, batch)
        step = buffers.prepare(scheduled, tables.array, batch)
        packed = step.packed
        ids, positions, slots, seqs = _reference(scheduled)
        assert packed.input_ids.tolist() == ids
        assert packed.positions.tolist() == positions
        assert packed.slots.tolist() == slots
        assert packed.seqs == seqs
        assert not packed.all_decodes
        # The same walk: every sequence reaches its last token, so each samples its last row.
        assert step.sample_rows == [seq.row + seq.num_tokens - 1 for seq in seqs] and step.direct
        for item in scheduled:
            tables.release(item.seq)  # its row holds stale blocks for the next sequence that takes it
    decodes = [item for item in _scheduled(5, tables, batch) if item.num_tokens == 1]
    packed = buffers.prepare(decodes, tables.array, batch).packed
    assert packed.all_decodes and packed.slots.tolist() == _reference(decodes)[2]
