"""Shared fixtures: the demo model in float64 (so greedy ties cannot flake) and a Hugging Face reference."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from graph_helpers import Rerun
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchgen.server.engine import EngineConfig, EngineRequest, EngineResult, LLMEngine
from batchgen.server.engine.runner import model_runner


@pytest.fixture(scope="session", autouse=True)
def demo_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Build the demo model into a private cache so tests never depend on the user's home."""
    path = tmp_path_factory.mktemp("batchgen-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHGEN_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model gains nothing from threads, and on shared cores OpenMP barriers make every op wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def demo_path(demo_cache_dir: Path) -> Path:
    from batchgen.server.engine.loading.demo_model import demo_model_dir

    return demo_model_dir()


@pytest.fixture(scope="session")
def tokenizer(demo_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(demo_path)


@pytest.fixture(scope="session")
def engine_model(demo_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(demo_path, dtype=torch.float64).eval()


@pytest.fixture(scope="session")
def hf_model(demo_path: Path) -> Any:
    """A separate copy with transformers' own attention: the reference the engine must match."""
    model = AutoModelForCausalLM.from_pretrained(demo_path, dtype=torch.float64, attn_implementation="sdpa")
    return model.eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model: Any) -> Callable[[list[int], int], list[int]]:
    """Greedy tokens from ``generate()`` run on one prompt alone (stops at EOS like the engine)."""

    @cache
    def generate(prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
        return out[0, len(prompt) :].tolist()

    return lambda prompt, max_new_tokens: generate(tuple(prompt), max_new_tokens)


@pytest.fixture
def make_engine(engine_model: Any, tokenizer: Any) -> Callable[..., LLMEngine]:
    def make(**overrides: Any) -> LLMEngine:
        config = EngineConfig(model="demo", dtype="float64", device="cpu", **{"num_kv_blocks": 512, **overrides})
        return LLMEngine(engine_model, tokenizer, config, "demo")

    return make


def _run_to_completion(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, EngineResult]:
    for request in requests:
        engine.add_request(request)
    results: dict[str, EngineResult] = {}
    for _ in range(100_000):
        if not engine.has_unfinished_requests():
            break
        for result in engine.step():
            results[result.request_id] = result
    assert not engine.has_unfinished_requests()
    return results


def _random_prompts(count: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


@pytest.fixture(scope="session")
def run_to_completion() -> Callable[[LLMEngine, list[EngineRequest]], dict[str, EngineResult]]:
    """Add the requests, step until the engine is idle, return every result by request id."""
    return _run_to_completion


@pytest.fixture(scope="session")
def random_prompts() -> Callable[..., list[list[int]]]:
    """``random_prompts(count, min_len, max_len, seed=0)``: byte-token prompts of random lengths."""
    return _random_prompts


@pytest.fixture
def graphs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Engines built meanwhile decode through the runner's CUDA-graph path, with ``Rerun`` for the graphs."""
    monkeypatch.setattr(model_runner, "uses_graphs", lambda *args: True)
    monkeypatch.setattr(model_runner, "CudaGraph", Rerun)
    Rerun.replays = 0
    with torch.compiler.set_stance("force_eager"):  # the plumbing, not the fast kernels (tested elsewhere)
        yield
