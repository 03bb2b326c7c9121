"""Quantized models on CPU: weight memory and decode tokens/s of a float32 Llama against each CPU method on the same
workload, and the KV cache's capacity in tokens with a 16-bit cache against float32 in the same memory.

    python benchmarks/quantized.py                      # hidden 1024, 8 layers: decode reads ~400 MB of weights
    python benchmarks/quantized.py --layers 4 --enforce-eager

A random Llama (the demo tokenizer's vocabulary) is saved once as float32; each method quantizes it as it loads
(``--quantization``, through transformers' own quantizers), through ``build_engine`` (the server's path, the
self-check included). Decode: ``--seqs`` sequences of 16-token prompts, ``--tokens`` new tokens each, greedy; the
rate counts the whole run (the short prefills included, as vLLM's ``generate``), after a first round that
compiles the step's shapes. vLLM's CPU build runs the same model and workload with each method it takes
(``vllm_peer.py --quantization``), its tokens compared with the engine's.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-server" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-schemas" / "src"))

from engine_throughput import run_vllm, same_tokens, vllm_python

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams, build_engine
from batchgen.server.engine.loading.demo_model import build_model, build_tokenizer

METHODS = {"float32": None, "bitsandbytes (4-bit nf4)": "bitsandbytes", "torchao (int8 weight-only)": "torchao"}


def save_model(path: Path, hidden: int, layers: int) -> None:
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    sizes = {"hidden_size": hidden, "intermediate_size": hidden * 11 // 4, "num_hidden_layers": layers}
    model = build_model(len(tokenizer), vocab["<|bos|>"], vocab["<|eos|>"], vocab["<|pad|>"], **sizes)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def weight_mib(engine: LLMEngine) -> float:
    """The model's weights as saved (its state dict through ``torch.save``): a quantized tensor's real storage, where
    ``get_memory_footprint`` takes torchao's int8 tensor for the float dtype it reports."""
    buffer = io.BytesIO()
    torch.save(engine.runner.model.state_dict(), buffer)
    return buffer.tell() / 2**20


def prompts(seqs: int) -> list[list[int]]:
    return [[(i * 7 + j) % 256 for j in range(16)] for i in range(seqs)]


def generation_rate(engine: LLMEngine, seqs: int, tokens: int) -> tuple[float, list[list[int]]]:
    """Generated tokens per second of ``seqs`` greedy sequences of ``tokens`` each (their 16-token prefills included,
    as in vLLM's ``generate``), and their tokens."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts(seqs)):
        engine.add_request(EngineRequest(str(i), prompt, params))
    start, outputs = time.perf_counter(), {}
    while engine.has_unfinished_requests():
        outputs.update((int(r.request_id), r.outputs[0].token_ids) for r in engine.step())
    return seqs * tokens / (time.perf_counter() - start), [outputs[i] for i in range(seqs)]


def vllm_rows(model: Path, args: argparse.Namespace, ours: dict[str | None, list[list[int]]]) -> list[str]:
    """vLLM's CPU build on the same model and workload, for each method it takes (``vllm_peer.py --quantization``):
    a table row, or why it could not run."""
    python = None if args.skip_vllm else vllm_python(None)
    if python is None:
        return ["| vLLM | - | - | - | not run (no vLLM build here, or --skip-vllm) |"]
    args.device, args.dtype, args.max_num_batched_tokens, args.kv_cache_gib = "cpu", "float32", 1024, 1
    workload = [[prompt, args.tokens] for prompt in prompts(args.seqs)]
    rows, base = [], None
    for name, method in METHODS.items():
        extra = ("--max-model-len", "1024", *(("--quantization", method) if method else ()))
        try:
            row, tokens = run_vllm(python, model, workload, args, eager=args.enforce_eager, extra=extra)
        except RuntimeError as exc:
            rows.append(f"| {row_name(name)} (vLLM) | - | - | - | refused or failed: {last_line(exc)} |")
            continue
        rate = row.tokens_per_second(cpu=False)
        base = base or rate
        note = same_tokens(ours[method], tokens) if method in ours else ""
        rows.append(f"| {row_name(name)} ({row.name}) | - | {rate:.1f} | {rate / base:.2f}x | {note} |")
    return rows


def row_name(name: str) -> str:
    return name.split(" (")[0]


def last_line(exc: Exception) -> str:
    """The error's own line: the last that is not a pointer to pydantic's documentation."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and "errors.pydantic.dev" not in line]
    return lines[-1][:200] if lines else type(exc).__name__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per method: the best one counts")
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
        print("| method | weight MiB | generated tok/s | vs float32 | fast paths / tokens |")
        print("|---|---:|---:|---:|---|")
        base, ours = None, {}
        for name, method in METHODS.items():
            config = EngineConfig(
                model=str(path), device="cpu", quantization=method, num_kv_blocks=256, enforce_eager=args.enforce_eager
            )
            engine = build_engine(config)
            assert isinstance(engine, LLMEngine)
            memory = weight_mib(engine)
            generation_rate(engine, args.seqs, 4)  # a first round compiles the step's shapes: not timed
            rounds = [generation_rate(engine, args.seqs, args.tokens) for _ in range(args.rounds)]
            rate, ours[method] = max(r for r, _ in rounds), rounds[0][1]
            base = base or rate
            paths = (
                ", ".join(f"{p}: {'on' if off is None else 'off'}" for p, off in engine.stats().fast_paths) or "eager"
            )
            print(f"| {name} | {memory:.0f} | {rate:.1f} | {rate / base:.2f}x | {paths} |", flush=True)
        print("\n".join(vllm_rows(path, args, ours)))
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
