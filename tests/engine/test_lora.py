"""LoRA adapters (``engine/features/lora.py``): adapters made with peft on the demo model (float32), mixed with the
base in one batch, against peft's own forward of each; through the eager, compiled and CUDA-graph paths; the
refusals."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_helpers import make_adapters, peft_reference
from transformers import AutoModelForCausalLM

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from batchgen.server.engine.errors import ModelLoadError
from batchgen.server.engine.features.adapters import AdapterRefused, Adapters, adapter_config
from batchgen.server.engine.runner import model_runner
from batchgen.server.engine.self_check import check_engine

NAMES = [None, "alpha", "beta", "gamma"]
TOKENS = 10


@pytest.fixture(scope="module")
def adapters(demo_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(demo_path, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def served(adapters: dict[str, Path]) -> Adapters:
    return Adapters("demo", 8, tuple(f"{name}={path}" for name, path in adapters.items()))


@pytest.fixture(scope="module")
def peft_greedy(demo_path: Path, adapters: dict[str, Path]) -> Callable[[list[int], int, str | None], list[int]]:
    return peft_reference(demo_path, adapters)


def lora_engine(demo_path: Path, tokenizer: Any, adapters: dict[str, Path], **overrides: Any) -> LLMEngine:
    """Its own float32 model (the LoRA hooks go on the model), two slots for three adapters: rows wait for a slot."""
    model = AutoModelForCausalLM.from_pretrained(demo_path, dtype=torch.float32).eval()
    config = EngineConfig(
        model="demo", dtype="float32", device="cpu", num_kv_blocks=256, block_size=8, max_num_batched_tokens=32,
        enable_lora=True, lora_modules=tuple(f"{name}={path}" for name, path in adapters.items()), max_loras=2,
        max_lora_rank=8, **overrides,
    )  # fmt: skip
    engine = LLMEngine(model, tokenizer, config, "demo")
    if config.self_check:  # as the factory does: the base, then the first adapter through the slots
        check_engine(engine)
    return engine


def check_mix(
    engine: LLMEngine,
    served: Adapters,
    peft_greedy: Callable[[list[int], int, str | None], list[int]],
    run_to_completion: Callable[..., Any],
) -> None:
    """Prompts sharing a 16-token prefix, each under the base and each adapter, twice (the second round from the
    prefix cache): every output is peft's greedy one for its adapter, and no adapter reads another's blocks."""
    shared = list(range(40, 56))
    prompts = [[*shared, 7 * i % 256, 100 + i, *range(i)] for i in range(4)]
    for round_ in range(2):
        requests = [
            EngineRequest(
                f"{round_}-{i}-{name}", prompt, SamplingParams(max_tokens=TOKENS, ignore_eos=True),
                lora=served.get(name) if name else None,
            )
            for i, prompt in enumerate(prompts)
            for name in NAMES
        ]  # fmt: skip
        results = run_to_completion(engine, requests)
        outputs: dict[str | None, list[list[int]]] = {}
        for request in requests:
            result = results[request.request_id]
            assert result.error is None, result.error
            name = request.lora.name if request.lora else None
            tokens = result.outputs[0].token_ids
            assert tokens == peft_greedy(request.prompt_token_ids, TOKENS, name), request.request_id
            outputs.setdefault(name, []).append(tokens)
            if round_:  # the whole shared prefix and more came from its own adapter's blocks
                assert result.cached_tokens >= 16, request.request_id
        assert len({json.dumps(outputs[name]) for name in NAMES}) == len(NAMES), "an adapter left the text unchanged"


def test_an_adapter_reads_no_other_adapters_cached_blocks(
    demo_path: Path, tokenizer: Any, adapters: dict[str, Path], served: Adapters, run_to_completion: Callable[..., Any]
) -> None:
    engine = lora_engine(demo_path, tokenizer, adapters, self_check=False)
    prompt = list(range(60, 90))
    cached = {}
    for name in [None, "alpha", "beta", "alpha"]:
        request = EngineRequest(f"r-{len(cached)}", prompt, SamplingParams(max_tokens=2), lora=served.get(name or ""))
        cached[len(cached)] = run_to_completion(engine, [request])[request.request_id].cached_tokens
    assert cached == {0: 0, 1: 0, 2: 0, 3: 24}


def test_a_mix_of_adapters_and_the_base_in_one_batch_is_peft_token_for_token(
    demo_path: Path,
    tokenizer: Any,
    adapters: dict[str, Path],
    served: Adapters,
    peft_greedy: Callable[[list[int], int, str | None], list[int]],
    run_to_completion: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the fast path, which tiny models skip by default: compiled layers with the LoRA hooks inside them, the
    packed linears under them. The same tokens as peft, no fast path fell back, every slot given back."""
    monkeypatch.setattr(model_runner, "EAGER_BELOW_PARAMETERS", 0)
    engine = lora_engine(demo_path, tokenizer, adapters)
    check_mix(engine, served, peft_greedy, run_to_completion)
    assert engine.runner.fast is not None and all(off is None for _, off in engine.stats().fast_paths)
    assert engine.lora is not None and engine.lora.users == [0, 0, 0]


def test_the_graph_path_applies_the_mix(
    graphs_on_cpu: None,
    demo_path: Path,
    tokenizer: Any,
    adapters: dict[str, Path],
    served: Adapters,
    peft_greedy: Callable[[list[int], int, str | None], list[int]],
    run_to_completion: Callable[..., Any],
) -> None:
    from graph_helpers import Rerun

    engine = lora_engine(demo_path, tokenizer, adapters)
    check_mix(engine, served, peft_greedy, run_to_completion)
    assert engine.runner.graphs is not None and Rerun.replays > 0 and engine.runner.graph_path.on


def _peft_adapter(demo_path: Path, path: Path, **spec: Any) -> Path:
    return make_adapters(demo_path, path, {"x": spec})["x"]


@pytest.mark.parametrize(
    ("spec", "refusal"),
    [
        ({"r": 4, "target_modules": ["q_proj"], "use_dora": True}, "it uses DoRA"),
        ({"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save: ['lm_head']"),
        ({"r": 4, "target_modules": ["embed_tokens"]}, "it adapts an embedding (base_model.model.model.embed_tokens"),
        ({"r": 16, "target_modules": ["q_proj"]}, "its rank 16 is above --max-lora-rank 8"),
        ({"r": 4, "target_modules": ["q_proj"], "bias": "lora_only"}, "it trains biases"),
        ({"r": 4, "target_modules": [], "target_parameters": ["mlp.down_proj.weight"]}, "it adapts weights directly"),
    ],
)
def test_what_the_engine_cannot_apply_exactly_is_refused_by_name(
    demo_path: Path, tmp_path: Path, spec: dict[str, Any], refusal: str
) -> None:
    path = _peft_adapter(demo_path, tmp_path, **spec)
    with pytest.raises(AdapterRefused, match="LoRA adapter 'x' cannot be served: ") as refused:
        adapter_config("x", path, 8)
    assert refusal in str(refused.value)
    with pytest.raises(AdapterRefused, match="cannot be served"):  # at start too: --lora-modules x=path
        Adapters("demo", 8, (f"x={path}",))


def test_a_request_for_an_adapter_of_another_model_fails_alone(
    demo_path: Path, tokenizer: Any, adapters: dict[str, Path], tmp_path: Path, run_to_completion: Callable[..., Any]
) -> None:
    """An adapter loaded at run time, made for another base (hidden size 32): its request fails with the reason when
    the engine reads it, the others run."""
    from batchgen.server.engine.loading.demo_model import BOS, EOS, PAD, build_model

    vocab = tokenizer.get_vocab()
    build_model(len(vocab), vocab[BOS], vocab[EOS], vocab[PAD], hidden_size=32).save_pretrained(tmp_path / "other")
    path = make_adapters(tmp_path / "other", tmp_path, {"x": {"r": 4, "target_modules": ["q_proj"]}})["x"]
    engine = lora_engine(demo_path, tokenizer, adapters, self_check=False)
    other = Adapters("demo", 8).add("other", str(path))
    requests = [
        EngineRequest("bad", [1, 2, 3], SamplingParams(max_tokens=2), lora=other),
        EngineRequest("good", [1, 2, 3], SamplingParams(max_tokens=2)),
    ]
    results = run_to_completion(engine, requests)
    error = results["bad"].error
    assert error is not None and error.code == "invalid_adapter"
    assert "LoRA adapter 'other' does not fit the model: model.layers.0.self_attn.q_proj has A (4, 32)" in error.message
    assert results["good"].error is None and len(results["good"].outputs[0].token_ids) == 2


def test_an_engine_without_lora_on_the_model_of_one_with_it_runs_the_base(
    demo_path: Path,
    tokenizer: Any,
    adapters: dict[str, Path],
    peft_greedy: Callable[[list[int], int, str | None], list[int]],
    run_to_completion: Callable[..., Any],
) -> None:
    """Engines on one model share it: the next engine takes the slots' hooks off (or puts its own on)."""
    first = lora_engine(demo_path, tokenizer, adapters, self_check=False)
    model = first.runner.model
    assert all(linear._forward_hooks for linear in first.lora.linears.values())  # type: ignore[union-attr]
    plain = LLMEngine(
        model, tokenizer, EngineConfig(model="demo", dtype="float32", device="cpu", num_kv_blocks=64), "demo"
    )
    assert plain.lora is None and not any(module._forward_hooks for module in model.modules())
    prompt = list(range(30, 50))
    result = run_to_completion(
        plain, [EngineRequest("base", prompt, SamplingParams(max_tokens=TOKENS, ignore_eos=True))]
    )
    assert result["base"].outputs[0].token_ids == peft_greedy(prompt, TOKENS, None)


def test_a_broken_adapter_fails_its_requests_alone(
    demo_path: Path,
    tokenizer: Any,
    adapters: dict[str, Path],
    served: Adapters,
    tmp_path: Path,
    peft_greedy: Callable[[list[int], int, str | None], list[int]],
    run_to_completion: Callable[..., Any],
) -> None:
    """Each broken adapter is refused by the load check or, past it, when the engine reads it: its requests fail with
    ``invalid_adapter``, and everyone else's (the base's, a good adapter's, in the same steps) run as peft's."""
    from lora_helpers import MALFORMED, malformed_adapters

    from batchgen.server.engine.features.adapters import LoRARequest

    broken = malformed_adapters(adapters["alpha"], tmp_path)
    for name in MALFORMED[:-2]:
        with pytest.raises(AdapterRefused):
            adapter_config(name, broken[name], 8)
    engine = lora_engine(demo_path, tokenizer, adapters, self_check=False)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    requests = [EngineRequest(f"bad-{name}", prompt, params, lora=LoRARequest(name, str(path), 1000 + i))
                for i, (name, path) in enumerate(broken.items())]  # fmt: skip
    requests += [
        EngineRequest("base", prompt, params),
        EngineRequest("alpha", prompt, params, lora=served.get("alpha")),
    ]
    results = run_to_completion(engine, requests)
    for name in MALFORMED[:-1]:  # the last one's weights are finite: it runs (test below)
        error = results[f"bad-{name}"].error
        assert error is not None and error.code == "invalid_adapter", (name, error)
    assert "NaN or infinite" in results["bad-nan-weights"].error.message
    assert results["base"].outputs[0].token_ids == peft_greedy(prompt, TOKENS, None)
    assert results["alpha"].outputs[0].token_ids == peft_greedy(prompt, TOKENS, "alpha")


def test_a_caller_that_waited_on_a_failed_read_reads_the_adapter_itself(
    demo_path: Path, tokenizer: Any, adapters: dict[str, Path], served: Adapters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads ask for an adapter not in memory (a request's reader and the engine taking its slot): the second
    waits for the first's read. The first's fails (its files unreadable for a moment): the second reads it itself and
    gets it. It once failed with a ``KeyError``, the in-progress entry gone with the first, and its request with it
    (as it would after the first's read was evicted by a third adapter's before the second looked)."""
    import threading

    from batchgen.server.engine.features import lora as lora_module

    engine = lora_engine(demo_path, tokenizer, adapters, self_check=False)
    assert engine.lora is not None
    engine.lora._cache.clear()
    read, first_reading, release = lora_module.read_adapter, threading.Event(), threading.Event()

    def flaky(*args: Any) -> Any:
        if not first_reading.is_set():
            first_reading.set()
            release.wait(5)
            raise OSError("the adapter's files cannot be read now")
        return read(*args)

    monkeypatch.setattr(lora_module, "read_adapter", flaky)
    alpha = served.get("alpha")
    assert alpha is not None
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(engine.lora.weights, alpha)
        assert first_reading.wait(5)
        second = pool.submit(engine.lora.weights, alpha)
        time.sleep(0.2)  # the second waits on the first's read
        release.set()
        with pytest.raises(OSError):
            first.result(5)
        assert second.result(5).request == alpha
    assert not engine.lora._reading


def test_what_one_adapter_makes_of_a_token_never_reaches_another_row(
    demo_path: Path, tokenizer: Any, adapters: dict[str, Path], tmp_path: Path, run_to_completion: Callable[..., Any]
) -> None:
    """An adapter whose finite weights overflow to inf in its own rows, in one step with the base: the base's tokens
    and logprobs are what they are alone, to float32's rounding (inf x 0 is NaN: a mask that multiplies would spread
    it to every row)."""
    from lora_helpers import malformed_adapters

    from batchgen.server.engine.features.adapters import LoRARequest

    huge = malformed_adapters(adapters["alpha"], tmp_path)["huge-weights-inf"]
    engine = lora_engine(demo_path, tokenizer, adapters, self_check=False)
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=True)
    prompt = [8, 6, 7, 5, 3, 0, 9]
    alone = run_to_completion(engine, [EngineRequest("alone", prompt, params)])["alone"].outputs[0]
    mixed = run_to_completion(
        engine,
        [
            EngineRequest("base", prompt, params),
            EngineRequest("huge", prompt, params, lora=LoRARequest("huge", str(huge), 7)),
        ],
    )
    assert mixed["huge"].error is None  # served: its own rows are its own business
    assert mixed["base"].outputs[0].token_ids == alone.token_ids
    mixed_logprobs = mixed["base"].outputs[0].logprobs
    assert mixed_logprobs is not None and alone.logprobs is not None
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(mixed_logprobs, alone.logprobs, strict=True))


def test_an_adapter_on_a_linear_the_forward_never_calls_is_refused(
    demo_path: Path,
    tokenizer: Any,
    adapters: dict[str, Path],
    served: Adapters,
    run_to_completion: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer that reads a linear's weight itself skips the hook (mamba-ssm's kernels read Mamba's ``dt_proj`` so;
    faked here on the MLP's ``down_proj``): the load probe finds it, and an adapter on it fails with the reason where
    it would have been served as if that part were not there (at start, one line; at run time, its requests alone)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    def fused(self: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.act_fn(self.gate_proj(x)) * self.up_proj(x), self.down_proj.weight)

    monkeypatch.setattr(LlamaMLP, "forward", fused)
    with pytest.raises(ModelLoadError, match=r"^--lora-modules: LoRA adapter 'beta' cannot be served: it adapts"):
        lora_engine(demo_path, tokenizer, adapters, self_check=False)  # at start: one line
    engine = lora_engine(demo_path, tokenizer, {"alpha": adapters["alpha"]}, self_check=False)
    assert engine.lora is not None
    assert engine.lora.unreached and all(name.endswith("mlp.down_proj") for name in engine.lora.unreached)
    params = SamplingParams(max_tokens=2)
    requests = [EngineRequest(name, [1, 2, 3], params, lora=served.get(name)) for name in ("gamma", "alpha")]
    results = run_to_completion(engine, requests)
    error = results["gamma"].error
    assert error is not None and error.code == "invalid_adapter"
    assert "it adapts 'model.layers.0.mlp.down_proj', whose weight the model's forward reads without" in error.message
    assert results["alpha"].error is None


def test_an_adapter_asked_for_twice_at_once_is_read_once(
    demo_path: Path, tokenizer: Any, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its weights read once (two readers at once had read two copies), the second caller given the first's."""
    from batchgen.server.engine.features import lora

    engine = lora_engine(demo_path, tokenizer, adapters)
    assert engine.lora is not None
    reads = []
    read = lora.read_adapter

    def slow_read(*args: Any) -> Any:
        reads.append(args[0].name)
        time.sleep(0.3)
        return read(*args)

    monkeypatch.setattr(lora, "read_adapter", slow_read)
    adapter = Adapters("demo", 8).add("late", str(adapters["gamma"]))  # not among those read at start
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: engine.lora.weights(adapter), range(2))  # type: ignore[union-attr]
    assert reads == ["late"] and first is second
