"""Output tokens/s of batchgen's engine on a DSA model (DeepSeek-V3.2-shaped, random weights) against the same model
without its indexer (DeepSeek-V3: the same MLA and MoE, full attention), and against transformers' ``generate``.

    python benchmarks/dsa_throughput.py            # 48 requests, prompts 64-768, outputs 16-64
    python benchmarks/dsa_throughput.py --quick    # 16 requests

The model: 4 layers, hidden 256, 8 heads, MLA (q rank 128, kv rank 64), MoE of 8 experts (2 per token), a 32,000-token
head; its indexer keeps ``--topk`` tokens (256: the selection bites on prompts past it) with 8 heads of 64. Rows:

- ``batchgen engine, DSA``: our engine (``dsa.py``: the indexer per sequence over its paged keys; attention over
  each query's causal, selected tokens).
- ``batchgen engine, no indexer``: the same weights as DeepSeek-V3 (every causal token), the engine's usual path,
  eager as DSA models run: what the selection costs.
- ``HF generate (static x16)``: ``model.generate()`` on left-padded batches of 16. transformers' continuous batching
  (``generate_batch``) does not run DSA (its paged cache knows full and sliding layers only), nor does vLLM's CPU
  build ("Sparse Attention is not supported on CPU", ``vllm/platforms/cpu.py``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-server" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-schemas" / "src"))

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from batchgen.server.engine.loading.demo_model import build_tokenizer

SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def make_model(model_type: str, topk: int) -> Any:
    extra = {"index_topk": topk, "index_n_heads": 8, "index_head_dim": 64} if model_type == "deepseek_v32" else {}
    config = AutoConfig.for_model(model_type, **SHAPE, **extra, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def share_weights(source: Any, target: Any) -> None:
    """``target`` (no indexer) takes ``source``'s weights: the same model without its selection."""
    missing = target.load_state_dict(source.state_dict(), strict=False)
    assert not missing.missing_keys, missing.missing_keys


def workload(n: int, prompt: tuple[int, int], output: tuple[int, int]) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    return [([rng.randrange(3, 32000) for _ in range(rng.randint(*prompt))], rng.randint(*output)) for _ in range(n)]


def run_engine(model: Any, work: list[tuple[list[int], int]]) -> tuple[int, float, float]:
    # Eager, as DSA models always run (the indexer is Python per sequence): like with like.
    config = EngineConfig(
        model="bench", dtype="float32", device="cpu", num_kv_blocks=4096, max_num_seqs=64, enforce_eager=True
    )
    engine = LLMEngine(model, build_tokenizer(), config, "bench")
    for i, (prompt, out) in enumerate(work):
        engine.add_request(EngineRequest(str(i), prompt, SamplingParams(max_tokens=out, ignore_eos=True)))
    wall, cpu, tokens = time.perf_counter(), time.process_time(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(result.outputs[0].token_ids) for result in engine.step() if result.finished)
    return tokens, time.perf_counter() - wall, time.process_time() - cpu


def run_generate(model: Any, work: list[tuple[list[int], int]], batch: int = 16) -> tuple[int, float, float]:
    model.set_attn_implementation("eager")
    wall, cpu, tokens = time.perf_counter(), time.process_time(), 0
    for start in range(0, len(work), batch):
        group = work[start : start + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(o for _, o in group), do_sample=False)
        tokens += sum(o for _, o in group)
    return tokens, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--quick", action="store_true", help="16 requests")
    parser.add_argument("--topk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = workload(16 if args.quick else args.requests, (64, 768), (16, 64))
    dsa = make_model("deepseek_v32", args.topk)
    dense = make_model("deepseek_v3", args.topk)
    share_weights(dsa, dense)
    rows = [
        ("batchgen engine, DSA", run_engine(dsa, work)),
        ("batchgen engine, no indexer", run_engine(dense, work)),
        ("HF generate (static x16), DSA", run_generate(dsa, work)),
    ]
    print(f"{len(work)} requests, prompts 64-768, outputs 16-64, index_topk {args.topk}, {args.threads} thread(s)")
    print(f"{'system':34} {'tokens':>7} {'wall s':>7} {'tok/s':>7} {'tok/CPU-s':>10}")
    for name, (tokens, wall, cpu) in rows:
        print(f"{name:34} {tokens:7d} {wall:7.1f} {tokens / wall:7.1f} {tokens / cpu:10.1f}")


if __name__ == "__main__":
    main()
