"""Each sequence's row of the block tables' array (what a step reads its blocks from) stays equal to its list
through every change the block manager makes: allocation, blocks from the prefix cache, ``n`` > 1 forks (sharing
the prompt's blocks, the last one copied), preemption, abort and finishing, with steps one at a time or overlapped,
over an array that starts at one row and one column and grows; and every row comes back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from batchgen.server.engine import EngineRequest, LLMEngine, SamplingParams
from batchgen.server.engine.core.block_tables import BlockTables


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_rows_follow_the_lists_and_all_come_back(
    make_engine: Callable[..., LLMEngine], random_prompts: Callable[..., Any], async_scheduling: str
) -> None:
    system = random_prompts(1, 24, 24, seed=4)[0]
    prompts = [system + suffix for suffix in random_prompts(12, 1, 30, seed=5)]
    engine = make_engine(num_kv_blocks=24, block_size=4, max_num_batched_tokens=32, async_scheduling=async_scheduling)
    engine.scheduler.block_manager.tables = tables = BlockTables(rows=1, columns=1)
    for i, prompt in enumerate(prompts):
        n = 3 if i % 4 == 0 else 1
        params = SamplingParams(max_tokens=12, n=n, temperature=1.0, seed=i, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    forks = steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 5:
            assert engine.abort_request("r1")
        seqs = [seq for state in engine._requests.values() for seq in state.seqs]
        forks = max(forks, sum(len(state.seqs) > 1 for state in engine._requests.values()))
        holders = [seq for seq in seqs if seq.block_table]
        assert all(seq.table_row == -1 for seq in seqs if not seq.block_table)
        assert len({seq.table_row for seq in holders}) == len(holders) == tables.rows_in_use
        for seq in holders:
            assert tables.array[seq.table_row, : len(seq.block_table)].tolist() == seq.block_table
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.cached_tokens > 0 and forks > 0
    assert tables.rows_in_use == 0 and tables.array.shape[0] > 1 and tables.array.shape[1] > 1  # it grew
