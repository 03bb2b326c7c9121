"""The engine against Hugging Face greedy decoding on tiny random models of common architectures.

Each model is built from its transformers config (sliding windows, soft-caps and logit scales small enough to
matter on short prompts), saved and loaded back through ``from_pretrained``; its LM head is scaled so greedy
decoding has clear margins. The engine must give the tokens of ``generate(do_sample=False)`` (eager attention, which
implements every feature) and logprobs within 1e-4, on plain prefill, chunked prefill, prefix-cache hits and n > 1.
Architectures the engine cannot drive must be refused at load, with a message naming them and why.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from graph_helpers import Rerun
from packaging.version import Version
from transformers import AutoConfig, AutoModelForCausalLM

from batchgen.server import cli
from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from batchgen.server.engine.errors import ModelNotSupported
from batchgen.server.engine.loading.demo_model import build_tokenizer
from batchgen.server.engine.runner import model_runner
from batchgen.server.engine.self_check import check_engine

WINDOW = 12
"""Sliding windows this small matter on the prompts below (up to 60 tokens, block size 8 or 16)."""

SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
ALTERNATING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen3": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1, "head_dim": 16},
    "gemma": {"head_dim": 16},
    "gemma2": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": WINDOW,
        "attn_logit_softcapping": 1.0,
        "final_logit_softcapping": 8.0,
    },
    "gemma3_text": {"head_dim": 16, **ALTERNATING, "final_logit_softcapping": 8.0},
    "phi3": {"sliding_window": WINDOW, "pad_token_id": 258},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512},
    "gpt_neox": {"num_key_value_heads": 4},
    "olmo2": {},
    "mixtral": {**MOE, "sliding_window": WINDOW},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
    "smollm3": {"pad_token_id": 258},
    "starcoder2": {"sliding_window": WINDOW},
    "granite": {"logits_scaling": 4.0, "attention_multiplier": 0.2, "residual_multiplier": 0.5},
    "cohere": {"logit_scale": 0.25},
    "cohere2": {**ALTERNATING},
    "stablelm": {},
    "gpt_oss": {**MOE, "sliding_window": WINDOW, "head_dim": 16},
    "phi": {},
    "olmo3": {**ALTERNATING},
    "exaone4": {**ALTERNATING},
    "gpt_bigcode": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512},
}

FALCON = {"num_kv_heads": 2, "new_decoder_architecture": True}
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "bloom": ({"n_embed": 64, "n_layer": 2, "n_head": 4}, "does not run through transformers' Attention"),
}
# Falcon's attention runs through the AttentionInterface from transformers 5.25 on: served (exactly) there.
if Version(transformers.__version__) >= Version("5.25"):
    ARCHITECTURES["falcon"] = FALCON
else:
    REFUSED["falcon"] = (FALCON, "does not run through transformers' Attention")

QK_GAIN = {"gemma2": 8.0}
"""Attention logits of random weights are tiny; these make them large enough for the soft-cap to bite."""

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def _build(model_type: str, extra: dict[str, Any], tokenizer: Any, path: Path) -> Path:
    special = {name: tokenizer.convert_tokens_to_ids(t) for name, t in (("bos", "<|bos|>"), ("eos", "<|eos|>"))}
    config = AutoConfig.for_model(
        model_type,
        **{**SIZES, "vocab_size": len(tokenizer), **extra},
        bos_token_id=special["bos"],
        eos_token_id=special["eos"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # clear greedy margins
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(QK_GAIN.get(model_type, 1.0))
    model.generation_config.eos_token_id = None  # every request runs to its length, in HF as in the engine
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@cache
def _prompts() -> tuple[tuple[int, ...], ...]:
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(40)]  # a prefix the second wave finds in the cache
    first = [tuple(rng.randrange(256) for _ in range(n)) for n in (5, 23, 38, 60)]
    second = [tuple(shared + [rng.randrange(256) for _ in range(n)]) for n in (3, 17)]
    return (*first, tuple(shared), *second)


class Reference:
    """Hugging Face greedy decoding (eager attention), memoized per prompt."""

    def __init__(self, path: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        self.model.eval()
        self._done: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}

    def greedy(self, prompt: tuple[int, ...]) -> tuple[list[int], torch.Tensor]:
        """The generated tokens and the log-softmax of the logits that chose each."""
        if prompt not in self._done:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
            logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
            self._done[prompt] = (out.sequences[0, len(prompt) :].tolist(), logprobs)
        return self._done[prompt]


def _engine(path: Path, tokenizer: Any, **overrides: Any) -> LLMEngine:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", **{"num_kv_blocks": 128, **overrides})
    engine = LLMEngine(model, tokenizer, config, path.name)
    check_engine(engine)  # the load-time self-check accepts every architecture served
    return engine


def _run(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, Any]:
    for request in requests:
        engine.add_request(request)
    results = {}
    while engine.has_unfinished_requests():
        results.update((r.request_id, r) for r in engine.step())
    return results


def _check(engine: LLMEngine, reference: Reference, n: int = 1) -> None:
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=3, n=n)
    prompts = _prompts()
    waves = [prompts[:5], prompts[5:]]  # the second wave's prompts extend the first's shared prefix
    for wave in waves:
        requests = [EngineRequest(f"{len(p)}-{i}", list(p), params) for i, p in enumerate(wave)]
        results = _run(engine, requests)
        for request, prompt in zip(requests, wave, strict=True):
            result = results[request.request_id]
            assert result.error is None, result.error
            expected_tokens, expected_logprobs = reference.greedy(prompt)
            assert len(result.outputs) == n
            for output in result.outputs:
                assert output.token_ids == expected_tokens, f"prompt of {len(prompt)} tokens"
                assert output.logprobs is not None
                for lp, expected in zip(output.logprobs, expected_logprobs, strict=True):
                    assert abs(lp.logprob - expected[lp.token_id].item()) < 1e-4
                    for token_id, value in lp.top:
                        assert abs(value - expected[token_id].item()) < 1e-4
            if wave is waves[1]:
                assert result.cached_tokens >= 32, "the shared prefix is served from the prefix cache"


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def architecture(
    request: pytest.FixtureRequest, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, Reference]]:
    path = _build(request.param, ARCHITECTURES[request.param], tokenizer, tmp_path_factory.mktemp(request.param))
    yield path, Reference(path)


def test_prefill_decode_and_prefix_cache(architecture: tuple[Path, Reference], tokenizer: Any) -> None:
    path, reference = architecture
    _check(_engine(path, tokenizer), reference)


def test_chunked_prefill_small_blocks_and_n(architecture: tuple[Path, Reference], tokenizer: Any) -> None:
    path, reference = architecture
    _check(_engine(path, tokenizer, block_size=8, max_num_batched_tokens=16), reference, n=2)


@pytest.mark.slow
def test_the_compiled_path(
    architecture: tuple[Path, Reference], tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast path, which tiny models skip by default (decoder layers compiled, the linears on packed weights,
    decodes through the C++ in-place kernel), on every architecture: the same tokens and logprobs, compiled once
    for chunked prefill, prefix-cache hits and n > 1 (the load-time self-check runs through it too), with no
    fallback. test_attention.py runs every kind of layer through the decode kernel."""
    path, reference = architecture
    monkeypatch.setattr(model_runner, "EAGER_BELOW_PARAMETERS", 0)
    engine = _engine(path, tokenizer, block_size=8, max_num_batched_tokens=16)
    _check(engine, reference, n=2)
    runner = engine.runner
    assert runner.fast is not None, "the fast forward fell back to eager"
    linears = [module for module in runner.model.modules() if isinstance(module, torch.nn.Linear)]
    assert linears and all(module.forward is runner.fast.forwards[module] for module in linears)
    layers = [module for module in runner.fast.forwards if not isinstance(module, torch.nn.Linear)]
    assert len(layers) == SIZES["num_hidden_layers"]
    assert all(off is None for _, off in engine.stats().fast_paths), engine.stats().fast_paths


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_flex_backend(model_type: str, tokenizer: Any, tmp_path: Path) -> None:
    """The GPU path's attention (FlexAttention over the paged cache in place), run eagerly: windows, soft-caps and
    sinks, chunked prefill, prefix-cache hits and n > 1. Eager FlexAttention ignores the block mask's sparsity, so
    test_attention.py checks the block mask on its own."""
    path = _build(model_type, ARCHITECTURES[model_type], tokenizer, tmp_path)
    reference = Reference(path)
    flex = {"attention_backend": "flex", "num_kv_blocks": 40}  # eager FlexAttention scores every cache slot
    _check(_engine(path, tokenizer, **flex, block_size=8, max_num_batched_tokens=16), reference, n=2)


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_at_load(model_type: str, tokenizer: Any, tmp_path: Path) -> None:
    extra, reason = REFUSED[model_type]
    path = _build(model_type, extra, tokenizer, tmp_path)
    with pytest.raises(ModelNotSupported, match=reason) as refused:
        _engine(path, tokenizer)
    assert type(AutoModelForCausalLM.from_pretrained(path)).__name__ in str(refused.value)


@pytest.mark.parametrize("command", ["serve", "run-batch"])
def test_the_commands_refuse_in_one_line(
    command: str, tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``serve`` and ``run-batch`` print the refusal as one line and exit 1, with no traceback."""
    path = _build("bloom", REFUSED["bloom"][0], tokenizer, tmp_path / "bloom")
    common = ["--model", str(path), "--served-model-name", "demo", "--device", "cpu", "--num-kv-blocks", "64"]
    if command == "serve":
        args = ["serve", *common, "--storage", str(tmp_path / "data"), "--port", "0"]
    else:
        inputs = Path(__file__).parents[2] / "examples" / "chat.jsonl"
        args = ["run-batch", "-i", str(inputs), "-o", str(tmp_path / "out.jsonl"), *common]
    capsys.readouterr()
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err  # transformers' own loading progress may come before the line
    assert err.strip().splitlines()[-1] == (
        "batchgen-server: batchgen cannot serve BloomForCausalLM models: its attention does not run through "
        "transformers' AttentionInterface, so the engine cannot give it a paged KV cache"
    )


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("/nowhere/model", "no model at '/nowhere/model': that directory does not exist"),
        ("./not-here", "no model at './not-here': that directory does not exist"),
    ],
)
def test_a_model_that_cannot_load_is_one_line(
    model: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = Path(__file__).parents[2] / "examples" / "chat.jsonl"
    args = [
        "run-batch",
        "-i",
        str(inputs),
        "-o",
        str(tmp_path / "o.jsonl"),
        "--model",
        model,
        "--served-model-name",
        "demo",
    ]
    assert cli.main(args) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"batchgen-server: {message}")


@pytest.fixture(scope="module")
def compiled_gemma2(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLMEngine, Reference]]:
    """An engine on the fast path, which tiny models skip by default, on Gemma 2 (GQA, a sliding window, attention
    soft-capping, a final soft-cap)."""
    path = _build("gemma2", ARCHITECTURES["gemma2"], tokenizer, tmp_path_factory.mktemp("gemma2-compiled"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_runner, "EAGER_BELOW_PARAMETERS", 0)
        yield _engine(path, tokenizer, block_size=8, max_num_batched_tokens=16), Reference(path)


def test_a_failing_fast_forward_falls_back_to_eager_for_good(
    compiled_gemma2: tuple[LLMEngine, Reference], caplog: pytest.LogCaptureFixture
) -> None:
    """A fast forward that fails where the model's own succeeds costs no request: the step runs eagerly, and the
    model's own forwards stay from then on."""
    engine, reference = compiled_gemma2
    fast = engine.runner.fast
    assert fast is not None
    head = engine.runner.model.get_output_embeddings()

    def broken(hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected")

    head.forward = fast.forwards[head] = broken
    _check(engine, reference)
    assert engine.runner.fast is None
    assert all("forward" not in vars(module) for module in fast.forwards)
    assert "compiled layers: off from now on" in caplog.text and "RuntimeError: injected" in caplog.text
    paths = dict(engine.stats().fast_paths)  # what /metrics and the start-up log show
    assert paths["compiled layers"] == paths["packed linears"] == "RuntimeError: injected"
    assert paths["decode kernel"] == "with the compiled forward (RuntimeError: injected)"


def test_cuda_graph_path(tokenizer: Any, tmp_path: Path, graphs_on_cpu: None) -> None:
    """Decode steps through the CUDA-graph path's static inputs (``Rerun`` for the graph itself) on a
    model whose layers alternate sliding and full attention: each window has its own static decode tables."""
    path = _build("gemma3_text", ARCHITECTURES["gemma3_text"], tokenizer, tmp_path)
    engine = _engine(path, tokenizer, block_size=8, max_num_batched_tokens=16)
    assert engine.runner.graphs is not None and engine.runner.graphs.windows == {WINDOW, None}
    _check(engine, Reference(path), n=2)
    assert engine.runner.graphs is not None and Rerun.replays > 0
