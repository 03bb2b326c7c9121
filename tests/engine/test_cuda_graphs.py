"""The decode graphs' plumbing, on CPU: static inputs, buckets, padding rows on the scratch block.

A CUDA graph cannot be had here, so ``Rerun`` (graph_helpers.py) stands in for one. Everything else is what runs on
a GPU: the runner routes steps of decodes alone to the graphs, the graphs refill their static inputs, and the outputs
must be HF's greedy tokens. test_architectures.py runs a model with windowed and full layers through them too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graph_helpers import Rerun

from batchgen.server.engine import EngineRequest, LLMEngine, SamplingParams
from batchgen.server.engine.attention import DecodeBlocks
from batchgen.server.engine.runner.cuda_graphs import batch_buckets


def test_batch_buckets() -> None:
    assert batch_buckets(256)[:6] == [1, 2, 4, 8, 16, 32] and batch_buckets(256)[-1] == 256
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1000)[-2:] == [960, 1000]


def test_decode_steps_replay_graphs_and_match_hf(
    graphs_on_cpu: None,
    make_engine: Callable[..., LLMEngine],
    run_to_completion: Callable[..., Any],
    random_prompts: Callable[..., list[list[int]]],
    hf_greedy: Callable[[list[int], int], list[int]],
) -> None:
    engine = make_engine(block_size=4, max_num_seqs=24)
    runner = engine.runner
    assert runner.graphs is not None and runner.cache.num_blocks == runner.num_blocks + 1  # the scratch block
    prompts = random_prompts(21, 2, 60, seed=30)  # batches shrink as they finish: buckets 24, 16, 8, 4, 2, 1
    lengths = [3 + i % 17 for i in range(len(prompts))]
    requests = [
        EngineRequest(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    results = run_to_completion(engine, requests)
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        assert results[f"r{i}"].outputs[0].token_ids == hf_greedy(prompt, n), f"prompt {i}"
    assert runner.graphs is not None, "no fallback to eager"
    buckets = {batch for batch, _ in runner.graphs._graphs}
    assert Rerun.replays > 10 and {1, 2, 4, 8, 16, 24} <= buckets
    assert len({width for _, width in runner.graphs._graphs}) > 1, "contexts grew past one width bucket"
    for (bucket, width), graph in runner.graphs._graphs.items():
        for blocks in graph.blocks.values():
            _assert_rows_stay_in_their_tables(blocks, bucket, width, runner.graphs.scratch_block)


def _assert_rows_stay_in_their_tables(blocks: DecodeBlocks, rows: int, width: int, scratch: int) -> None:
    """As the last replay left a graph's static tables: every row sees from 1 to ``width`` blocks (what the CUDA
    kernel walks); a padding row (position 0: a real decode has a token before it) sees the scratch block's first
    slot alone, and a real row's blocks are never the scratch block."""
    assert blocks.tables.shape == (rows, width) and blocks.first.shape == blocks.last.shape == (rows,)
    bs = blocks.block_size
    for row in range(rows):
        first, last = int(blocks.first[row]), int(blocks.last[row])
        seen = blocks.tables[row, : last // bs - first // bs + 1]
        assert 0 <= first <= last and 1 <= len(seen) <= width, f"row {row}"
        if last == 0:
            assert seen.tolist() == [scratch], f"padding row {row}"
        else:
            assert (seen != scratch).all(), f"row {row} reads the scratch block"


def test_a_one_token_prefill_chunk_keeps_its_step_off_the_graphs(
    graphs_on_cpu: None,
    make_engine: Callable[..., LLMEngine],
    run_to_completion: Callable[..., Any],
    random_prompts: Callable[..., list[list[int]]],
) -> None:
    """A graph returns logits for every row, so a step of one-token items that is not all sampled (a prompt's
    1-token chunk beside decodes: a budget of 3 tokens makes them) must run eagerly; sampled tokens and logprobs
    are those of the same requests run with a budget that never cuts a prompt."""
    prompts = random_prompts(6, 5, 12, seed=31)

    def requests() -> list[EngineRequest]:
        params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=7, logprobs=True, top_logprobs=2)
        return [EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]

    engine = make_engine(block_size=4, max_num_seqs=8, max_num_batched_tokens=3)
    mixed_steps, failures = [], []
    forward, start = engine.runner.forward, engine._start

    def spy_forward(packed: Any, sample_rows: list[int], *args: Any) -> Any:
        if packed.all_decodes and len(sample_rows) < len(packed.seqs):
            mixed_steps.append(len(packed.seqs))
        return forward(packed, sample_rows, *args)

    def spy_start(scheduled: list[Any]) -> Any:
        try:
            return start(scheduled)
        except Exception as exc:
            failures.append(exc)
            raise

    engine.runner.forward, engine._start = spy_forward, spy_start  # type: ignore[method-assign]
    chunked = run_to_completion(engine, requests())
    whole = run_to_completion(make_engine(block_size=4, max_num_seqs=8), requests())
    assert mixed_steps and Rerun.replays > 0  # both kinds of step happened
    assert failures == []
    for request_id, result in whole.items():
        assert chunked[request_id].outputs[0].token_ids == result.outputs[0].token_ids
        got, want = chunked[request_id].outputs[0].logprobs, result.outputs[0].logprobs
        assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
