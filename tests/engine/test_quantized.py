"""Quantized checkpoints through the real CLI (``run-batch``): each CPU-capable method served greedily identical to
transformers running the same checkpoint, ``--quantization`` quantizing a float checkpoint as it loads, and every
other method refused at load in one line that names it.

Each checkpoint is made by its library's own quantizer from one small random Llama, once for the module. The CLI runs
in child processes forked together from the fork server (``server_helpers.forked_cli``), and a crash in native code
(torchao's int8 weights read as float32 by a fast path crashed with exit 139) fails its case instead of ending the
run."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from server_helpers import forked_cli
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TorchAoConfig

from batchgen.server.cli import main
from batchgen.server.engine.config import EngineConfig
from batchgen.server.engine.loading.quantization import in_flight

pytest.importorskip("bitsandbytes")
pytest.importorskip("torchao")
pytest.importorskip("compressed_tensors")

PROMPTS = [[1, 2, 3, 4, 5], [70, 71, 72], [200, 10, 20, 30, 40, 50, 60]]
NEW_TOKENS = 8


# The real CLI, with the compiled layers on for this small model (they stay eager below 10M parameters).
def _bitsandbytes(bits: int) -> Any:
    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")


def _torchao_int8() -> Any:
    from torchao.quantization import Int8WeightOnlyConfig

    return TorchAoConfig(quant_type=Int8WeightOnlyConfig())


def _compressed_tensors(plain: Path, out: Path, preset: str) -> None:
    """What llm-compressor writes for ``preset`` (W8A8, W4A16, FP8_DYNAMIC), its weights' scales from their range
    (its dynamic activations need no calibration)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model = AutoModelForCausalLM.from_pretrained(plain)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            weight = module.weight
            if args.group_size:
                weight = weight.reshape(weight.shape[0], -1, args.group_size)
            scale, zero = calculate_qparams(weight.amin(-1), weight.amax(-1), args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))


def _refused_config(plain: Path, out: Path, quantization: dict[str, Any]) -> None:
    """The float checkpoint with a quantization_config this machine cannot make (a GPU's method): the refusal reads
    the config alone, before any weight."""
    out.mkdir()
    for path in plain.iterdir():
        (out / path.name).symlink_to(path)
    (out / "config.json").unlink()
    config = json.loads((plain / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))


REFUSED = {  # checkpoint -> its quantization_config, as its quantizer writes it
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "torchao-int4": {
        "quant_method": "torchao",
        "quant_type": {"default": {"_type": "Int4WeightOnlyConfig", "_version": 2, "_data": {"group_size": 32}}},
    },
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, demo_path: Path) -> dict[str, Path]:
    """Every checkpoint by name: the float one, each quantized one, each refused one."""
    from batchgen.server.engine.loading.demo_model import build_model

    root = tmp_path_factory.mktemp("quantized")
    tokenizer = AutoTokenizer.from_pretrained(demo_path)
    vocab = tokenizer.get_vocab()
    plain = root / "plain"
    model = build_model(len(tokenizer), vocab["<|bos|>"], vocab["<|eos|>"], vocab["<|pad|>"], hidden_size=128)
    model.save_pretrained(plain)
    tokenizer.save_pretrained(plain)
    paths = {"plain": plain}
    quantizers: dict[str, Callable[[], Any]] = {
        "bitsandbytes-8bit": lambda: _bitsandbytes(8),
        "bitsandbytes-4bit": lambda: _bitsandbytes(4),
        "torchao-int8": _torchao_int8,
    }
    for name, quantization in quantizers.items():
        paths[name] = root / name
        quantized = AutoModelForCausalLM.from_pretrained(plain, quantization_config=quantization())
        quantized.save_pretrained(paths[name], safe_serialization=name != "torchao-int8")  # torchao's: pickled
    for preset in ("W8A8", "W4A16"):
        paths[f"compressed-tensors-{preset}"] = root / f"compressed-tensors-{preset}"
        _compressed_tensors(plain, paths[f"compressed-tensors-{preset}"], preset)
    for name in paths.keys() - {"plain"}:
        tokenizer.save_pretrained(paths[name])
    for name, quantization in REFUSED.items():
        paths[name] = root / name
        _refused_config(plain, paths[name], quantization)
    return paths


SERVED = {  # case -> (checkpoint, flags, the quantization transformers loads it with for the reference)
    "bitsandbytes-8bit": ("bitsandbytes-8bit", (), None),
    "bitsandbytes-4bit": ("bitsandbytes-4bit", (), None),
    "torchao-int8 (compiled layers)": ("torchao-int8", ("compiled",), None),
    "compressed-tensors-W8A8": ("compressed-tensors-W8A8", (), None),
    "compressed-tensors-W4A16": ("compressed-tensors-W4A16", (), None),
    "--quantization bitsandbytes": ("plain", ("--quantization", "bitsandbytes"), "bitsandbytes"),
    "--quantization torchao": ("plain", ("--quantization", "torchao"), "torchao"),
}


def _input(path: Path, model: str) -> Path:
    lines = [
        {
            "custom_id": str(i),
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        }
        for i, prompt in enumerate(PROMPTS)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _expected(path: Path, quantization: str | None) -> list[str]:
    """Transformers' greedy text for each prompt, from the same checkpoint (or the same in-flight quantization)."""
    kwargs: dict[str, Any] = {}
    if quantization is not None:
        config = AutoModelForCausalLM.from_pretrained(path).config
        kwargs["quantization_config"] = in_flight(quantization, config, torch.device("cpu"), torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        texts.append(tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True))
    return texts


@pytest.mark.slow
def test_each_cpu_method_serves_through_the_cli_exactly(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    children = {}
    for case, (checkpoint, flags, _) in SERVED.items():
        work = tmp_path / case.replace(" ", "_").replace("/", "_")
        work.mkdir()
        argv = ["run-batch", "-i", str(_input(work / "in.jsonl", str(checkpoints[checkpoint])))]
        argv += ["-o", str(work / "out.jsonl"), "--model", str(checkpoints[checkpoint]), "--no-progress"]
        argv += ["--device", "cpu", "--num-kv-blocks", "64", "--torch-threads", "1"]
        argv += [flag for flag in flags if flag != "compiled"]
        children[case] = (forked_cli(argv, work / "log", compiled="compiled" in flags), work)
    failures = []
    for case, (child, work) in children.items():
        if child.wait(600) != 0:
            failures.append(f"{case}: exit {child.returncode}\n{(work / 'log').read_text()[-2000:]}")
            continue
        answered = {
            line["custom_id"]: line["response"]["body"]["choices"][0]["text"]
            for line in map(json.loads, (work / "out.jsonl").read_text().splitlines())
        }
        checkpoint, _, quantization = SERVED[case]
        expected = _expected(checkpoints[checkpoint], quantization)
        if [answered[str(i)] for i in range(len(PROMPTS))] != expected:
            failures.append(f"{case}: {answered} != transformers' {expected}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    ("checkpoint", "flags", "message"),
    [
        ("fp8", (), "fp8 (FineGrainedFP8) needs a CUDA GPU with compute capability >= 8.9; on CPU quantize"),
        ("gptq", (), "GPTQ needs a CUDA GPU"),
        ("awq", (), "AWQ needs a CUDA GPU"),
        ("torchao-int4", (), "torchao Int4WeightOnlyConfig needs a CUDA GPU"),
        ("plain", ("--quantization", "fp8"), "--quantization fp8: fp8 (FineGrainedFP8) needs a CUDA GPU"),
        ("plain", ("--kv-cache-dtype", "fp8"), "--kv-cache-dtype fp8: an fp8 KV cache is not supported on CPU"),
        ("bitsandbytes-8bit", ("--quantization", "torchao"), "already quantized with bitsandbytes"),
        (  # before any rank starts (rank 1 died of 'list index out of range')
            "bitsandbytes-8bit",
            ("--tensor-parallel-size", "2"),
            "its checkpoint is quantized (bitsandbytes) and --tensor-parallel-size 2 is asked for",
        ),
    ],
)
def test_what_cannot_run_on_cpu_is_refused_by_name_in_one_line(
    checkpoints: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    checkpoint: str,
    flags: tuple[str, ...],
    message: str,
) -> None:
    path = str(checkpoints[checkpoint])
    source = _input(tmp_path / "in.jsonl", path)
    code = main(["run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--model", path, "--device", "cpu",
                 *flags])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("batchgen-server: ") and message in err and err.count("\n") == 1, err


def test_kv_cache_dtype_is_a_usage_error_when_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run-batch", "-i", "x", "-o", "y", "--kv-cache-dtype", "int3"])
    assert exited.value.code == 2 and "--kv-cache-dtype 'int3': use auto" in capsys.readouterr().err
    assert EngineConfig(quantization="gguf").usage_problem() == "--quantization 'gguf': use bitsandbytes, torchao, fp8"


def test_a_16_bit_kv_cache_holds_twice_the_tokens_and_decodes_as_transformers(demo_path: Path) -> None:
    """The demo model (float32) with a bfloat16 cache: twice the tokens in the same memory, and greedy text identical
    to transformers' float32 forward (measured: 16/16 prompts over 32 tokens; a bf16 cache rounds K and V, so this
    holds on a model with clear greedy winners, not in general)."""
    import random

    from batchgen.server.engine import EngineRequest, SamplingParams, build_engine

    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 40))] for _ in range(16)]
    engines = {
        kv: build_engine(EngineConfig(model=str(demo_path), device="cpu", kv_cache_dtype=kv, cpu_kv_cache_gib=0.01))
        for kv in ("auto", "bfloat16")
    }
    full, half = engines["auto"].stats(), engines["bfloat16"].stats()
    assert (full.kv_cache_dtype, half.kv_cache_dtype) == ("float32", "bfloat16")
    assert half.kv_cache_tokens >= 2 * full.kv_cache_tokens - 16 and half.kv_cache_bytes <= 0.01 * 2**30
    engine = engines["bfloat16"]
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), prompt, SamplingParams(max_tokens=32, ignore_eos=True)))
    results: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        results.update((r.request_id, r.outputs[0].token_ids) for r in engine.step())
    model = AutoModelForCausalLM.from_pretrained(demo_path)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        assert results[str(i)] == expected[0, len(prompt) :].tolist(), i
