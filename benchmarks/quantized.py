"""Quantized models on CPU: weight memory and decode tokens/s of a float32 Llama against each CPU method on the same
workload, and the KV cache's capacity in tokens with a 16-bit cache against float32 in the same memory.

    python benchmarks/quantized.py                      # hidden 1024, 8 layers: decode reads ~400 MB of weights
    python benchmarks/quantized.py --layers 4 --enforce-eager

A random Llama (the demo tokenizer's vocabulary) is saved once as float32; each method quantizes it as it loads
(``--quantization``, through transformers' own quantizers), through ``build_engine`` (the server's path, the
self-check included). Decode: ``--seqs`` sequences of 16-token prompts, ``--tokens`` new tokens each, greedy; the
rate counts the decode steps only (prefill excluded). vLLM's CPU build is not measured here (see RESULTS.md).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-server" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-schemas" / "src"))

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams, build_engine
from batchgen.server.engine.demo_model import build_model, build_tokenizer

METHODS = {"float32": None, "bitsandbytes (4-bit nf4)": "bitsandbytes", "torchao (int8 weight-only)": "torchao"}


def save_model(path: Path, hidden: int, layers: int) -> None:
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    sizes = {"hidden_size": hidden, "intermediate_size": hidden * 11 // 4, "num_hidden_layers": layers}
    model = build_model(len(tokenizer), vocab["<|bos|>"], vocab["<|eos|>"], vocab["<|pad|>"], **sizes)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def decode_rate(engine: LLMEngine, seqs: int, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(EngineRequest(str(i), [(i * 7 + j) % 256 for j in range(16)], params))
    engine.step()  # the prefills (16 tokens x seqs fit one step's budget)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps * seqs / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        save_model(path, args.hidden, args.layers)
        print(
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, {args.threads} "
            f"thread(s); Llama hidden {args.hidden}, {args.layers} layers; {args.seqs} seqs x {args.tokens} tokens"
            f"{'; --enforce-eager' if args.enforce_eager else ''}\n"
        )
        print("| method | weight MiB | decode tok/s | vs float32 | fast paths |")
        print("|---|---:|---:|---:|---|")
        base = None
        for name, method in METHODS.items():
            config = EngineConfig(
                model=str(path), device="cpu", quantization=method, num_kv_blocks=256, enforce_eager=args.enforce_eager
            )
            engine = build_engine(config)
            assert isinstance(engine, LLMEngine)
            memory = engine.runner.model.get_memory_footprint() / 2**20
            rate = decode_rate(engine, args.seqs, args.tokens)
            base = base or rate
            paths = (
                ", ".join(f"{p}: {'on' if off is None else 'off'}" for p, off in engine.stats().fast_paths) or "eager"
            )
            print(f"| {name} | {memory:.0f} | {rate:.1f} | {rate / base:.2f}x | {paths} |", flush=True)
        print("\n| KV cache dtype | --cpu-kv-cache-gib | tokens | bytes |")
        print("|---|---:|---:|---:|")
        for kv in ("auto", "bfloat16"):
            config = EngineConfig(
                model=str(path), device="cpu", kv_cache_dtype=kv, cpu_kv_cache_gib=0.25, enforce_eager=True
            )
            stats = build_engine(config).stats()
            print(f"| {stats.kv_cache_dtype} | 0.25 | {stats.kv_cache_tokens} | {stats.kv_cache_bytes} |")


if __name__ == "__main__":
    main()
