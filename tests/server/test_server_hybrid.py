"""A hybrid model (Qwen3.5's layout: Gated DeltaNet linear attention beside full attention) served by the real server:
a batch whose lines share a prefix and an online streamed completion give the tokens of transformers' ``generate``
(a LoRA adapter's lines, mixed in, peft's), and ``/health`` and ``/metrics`` count the state cache beside the KV
cache."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lora_helpers import make_adapters, peft_model
from server_helpers import LiveServer, ServerProcess
from transformers import AutoConfig, AutoModelForCausalLM

from batchgen.server.engine.loading.demo_model import build_tokenizer

TOKENS = 8
PREFIX = "You are a terse assistant. Answer in one word. "
QUESTIONS = ["Sky?", "Grass?", "Snow at night?"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_5")
    tokenizer = build_tokenizer()
    config = AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # clear greedy margins
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


ADAPTER = {"r": 4, "lora_alpha": 8, "target_modules": ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "down_proj"]}
"""On the Gated DeltaNet layers' projections and the attention's and MLP's."""


@pytest.fixture(scope="module")
def adapter(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapters(model_dir, tmp_path_factory.mktemp("adapter"), {"gdn": ADAPTER})["gdn"]


@pytest.fixture(scope="module")
def server(model_dir: Path, adapter: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    args = ("--served-model-name", "hybrid", "--block-size", "8", "--max-num-batched-tokens", "32")
    args += ("--enable-lora", "--lora-modules", f"gdn={adapter}", "--max-lora-rank", "8")
    with ServerProcess(tmp_path_factory.mktemp("server"), *args, model=str(model_dir)) as process:
        live = LiveServer(process)
        yield live
        live.http.close()


def _expected(model_dir: Path, prompts: list[str], adapter: Path | None = None) -> list[str]:
    """transformers' greedy continuations of ``prompts`` (peft's, with ``adapter``)."""
    tokenizer = build_tokenizer()
    if adapter is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    else:
        model = peft_model(model_dir, {"adapter": adapter})
    texts = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False)
        texts.append(tokenizer.decode(out[0, ids.shape[1] :]))
    return texts


def _line(custom_id: str, prompt: str, model: str = "hybrid") -> dict[str, object]:
    body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def test_a_batch_and_a_streamed_request(server: LiveServer, model_dir: Path, adapter: Path) -> None:
    prompts = [PREFIX + question for question in QUESTIONS]
    lines = [_line(f"q{i}", prompt) for i, prompt in enumerate(prompts)]
    lines += [_line(f"gdn{i}", prompt, "gdn") for i, prompt in enumerate(prompts)]
    batch = server.run(lines, endpoint="/v1/completions")
    assert batch["status"] == "completed", (batch.get("errors"), server.raw(batch.get("error_file_id")))
    texts = {
        line["custom_id"]: line["response"]["body"]["choices"][0]["text"]
        for line in server.lines(batch["output_file_id"])
    }
    expected = {f"q{i}": text for i, text in enumerate(_expected(model_dir, prompts))}
    expected |= {f"gdn{i}": text for i, text in enumerate(_expected(model_dir, prompts, adapter))}
    assert texts == expected and texts["gdn1"] != texts["q1"]

    for model, key in (("hybrid", "q1"), ("gdn", "gdn1")):
        body = {"model": model, "prompt": prompts[1], "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
        streamed = ""
        with server.http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for event in response.iter_lines():
                if event.startswith("data: ") and event != "data: [DONE]":
                    streamed += "".join(choice["text"] for choice in json.loads(event[6:])["choices"])
        assert streamed == texts[key]

    kv_cache = server.http.get("/health").json()["kv_cache"]
    assert kv_cache["state_bytes_per_sequence"] > 0 and kv_cache["state_slots"] > 0
    assert kv_cache["state_bytes"] == kv_cache["state_slots"] * kv_cache["state_bytes_per_sequence"]
    metrics = server.http.get("/metrics").text
    assert f'batchgen_state_bytes_per_sequence{{model_name="hybrid"}} {kv_cache["state_bytes_per_sequence"]}' in metrics
