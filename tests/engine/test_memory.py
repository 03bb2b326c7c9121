"""The engine keeps nothing of a finished request (the fix for RSS growing with every request served), and sizes its
caches from what the largest step leaves."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen.server.engine import EngineConfig, EngineRequest, EngineResult, EngineWorker, LLMEngine, SamplingParams


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def _requests(prompts: list[list[int]], round_no: int) -> list[EngineRequest]:
    """Every kind of request: greedy, seeded sampling, stop strings, n > 1, logprobs, embeddings, chunked prefills."""
    kinds = [
        SamplingParams(max_tokens=3),
        SamplingParams(max_tokens=3, temperature=0.8, seed=1),
        SamplingParams(max_tokens=3, temperature=1.0, stop=("a",)),
        SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=2),
        SamplingParams(max_tokens=3, logprobs=True, top_logprobs=2, frequency_penalty=0.5),
    ]
    requests = [EngineRequest(f"{round_no}-{i}", prompt, kinds[i % len(kinds)]) for i, prompt in enumerate(prompts)]
    requests.append(EngineRequest(f"{round_no}-embed", prompts[0], task="embed"))
    return requests


def test_finished_requests_leave_no_state_and_no_tensors(
    make_engine: Callable[..., LLMEngine], random_prompts: Callable[..., Any]
) -> None:
    # Small step budget: long prompts are prefilled in chunks, the second against its cached first part.
    engine = make_engine(num_kv_blocks=96, max_num_batched_tokens=64)
    worker = EngineWorker(engine)  # its own thread: grad mode is per thread, where the autograd leak came from
    prompts = random_prompts(20, 5, 150, seed=7)

    def run_round(round_no: int) -> None:
        requests = _requests(prompts, round_no)
        results: list[EngineResult] = []
        done = threading.Event()

        def on_result(result: EngineResult) -> None:
            results.append(result)
            if len(results) == len(requests):
                done.set()

        worker.submit(requests, on_result)
        assert done.wait(60), worker.error
        assert all(result.error is None for result in results)

    worker.start()
    try:
        run_round(0)  # warm up: the gather buffers reach their size
        tensors_after_first = _live_tensors()
        run_round(1)  # the same requests again (now mostly from the prefix cache)
        assert _live_tensors() == tensors_after_first
    finally:
        worker.stop(timeout=10)

    assert worker._held == {}
    assert engine._requests == {} and engine._ready == []
    assert not engine.scheduler.waiting and not engine.scheduler.running
    block_manager = engine.scheduler.block_manager
    assert block_manager.ref_counts == [0] * block_manager.num_blocks
    assert block_manager.num_free_blocks == block_manager.num_blocks
    assert len(block_manager.hash_to_block) <= block_manager.num_blocks  # the prefix cache is bounded by the cache
    for cache in (*engine.runner.cache.k, *engine.runner.cache.v):
        assert cache.grad_fn is None and not cache.requires_grad
    assert not any(p.requires_grad for p in engine.runner.model.parameters())


def test_the_caches_get_what_is_left_beside_the_largest_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where a budget sizes the caches, the largest step the scheduler may send runs once before they exist and its
    peak is measured (on CPU the process's peak resident set): it grows with the step's tokens (4,096 of them hold
    at least the MLP's 4,096 x 1,024 float32 activations, 16 MiB). On a machine with less left than
    ``--cpu-kv-cache-gib`` asks, the caches take what the step leaves, and a warning says so."""
    from test_architectures import _build

    from batchgen.server.engine import build_engine
    from batchgen.server.engine.loading.demo_model import build_tokenizer
    from batchgen.server.engine.runner import profile
    from batchgen.server.media.budget import give_back_memory

    path = _build("llama", {"hidden_size": 256, "intermediate_size": 1024}, build_tokenizer(), tmp_path)

    def runner(tokens: int) -> Any:
        give_back_memory()  # what earlier tests freed is not held resident, where the step would reuse it unseen
        config = EngineConfig(
            model=str(path), device="cpu", dtype="float32", max_num_batched_tokens=tokens, torch_threads=1
        )
        engine = build_engine(config)
        engine.close()
        return engine.runner

    small, large = runner(128), runner(4096)
    assert large.step_bytes >= 16 * 2**20 and large.step_bytes > 2 * small.step_bytes
    assert large.num_blocks == 2**30 // large.block_bytes  # 1 GiB asked: the machine has it

    left = 2 * large.step_bytes  # under the 1 GiB asked
    monkeypatch.setattr(profile, "_available_bytes", lambda: left)
    with caplog.at_level("WARNING", logger=profile.__name__):
        cut = runner(4096)
    assert cut.num_blocks == (left - cut.step_bytes) // cut.block_bytes > 0
    assert "--cpu-kv-cache-gib 1.00: this machine has" in caplog.text
