"""Quantized checkpoints on the engine's fast path: a weight that is a tensor subclass (torchao's int8) steps aside
from the packed linears and the native kernels, where reading it as plain float32 crashed the process (exit 139).

Each case runs in a child process, so that a crash in native code fails the test instead of ending the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchao")

PROMPTS = [[1, 2, 3, 4, 5], [70, 71, 72], [200, 10, 20, 30, 40, 50, 60]]
NEW_TOKENS = 8

# In the child: the compiled path (the test models are small), greedy tokens from the engine and from transformers.
CHILD = """
import json, sys, torch
from batchgen.server.engine import model_runner
model_runner.EAGER_BELOW_PARAMETERS = 0
from batchgen.server.engine import EngineConfig, EngineRequest, SamplingParams, build_engine
from transformers import AutoModelForCausalLM

path, prompts, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
engine = build_engine(EngineConfig(model=path, device="cpu", num_kv_blocks=64))
for i, prompt in enumerate(prompts):
    engine.add_request(EngineRequest(str(i), prompt, SamplingParams(max_tokens=new, ignore_eos=True)))
results = {}
while engine.has_unfinished_requests():
    results.update((r.request_id, r.outputs[0].token_ids) for r in engine.step())
model = AutoModelForCausalLM.from_pretrained(path)
expected = [
    model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=new,
                   do_sample=False)[0, len(p):].tolist()
    for p in prompts
]
linears = [m for m in engine.runner.model.modules() if isinstance(m, torch.nn.Linear)]
quantized = [m for m in linears if type(m.weight).__name__ != "Parameter"]
packed_quantized = sum("forward" in vars(m) for m in quantized)
print(json.dumps({"engine": [results[str(i)] for i in range(len(prompts))], "transformers": expected,
                  "fast_paths": engine.stats().fast_paths, "packed_quantized": packed_quantized}))
"""


def _run(path: Path) -> dict[str, Any]:
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), json.dumps(PROMPTS), str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, f"exit {child.returncode}:\n{child.stderr[-3000:]}"
    return json.loads(child.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def torchao_int8(tmp_path_factory: pytest.TempPathFactory, demo_path: Path) -> Path:
    """A small random Llama quantized by transformers' own torchao quantizer (int8 weight-only), saved."""
    import torch
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, TorchAoConfig

    tokenizer = AutoTokenizer.from_pretrained(demo_path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # clear greedy winners
    plain, quantized = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("torchao-int8")
    model.save_pretrained(plain)
    quantization = TorchAoConfig(quant_type=Int8WeightOnlyConfig())
    AutoModelForCausalLM.from_pretrained(plain, quantization_config=quantization).save_pretrained(
        quantized, safe_serialization=False
    )
    tokenizer.save_pretrained(quantized)
    return quantized


def test_a_torchao_int8_checkpoint_serves_on_the_fast_path_exactly(torchao_int8: Path) -> None:
    result = _run(torchao_int8)
    assert result["engine"] == result["transformers"]
    assert result["packed_quantized"] == 0  # the quantized linears keep their own (torchao's) forward
    assert dict(result["fast_paths"])["compiled layers"] is None
