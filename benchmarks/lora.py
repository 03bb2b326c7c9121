"""Output tokens/s of a mix of LoRA adapters against the base model alone, on the same requests.

    python benchmarks/lora.py                 # 4 adapters, 64 requests (slow on CPU)
    python benchmarks/lora.py --quick         # 32 requests, shorter prompts and outputs

Model and workload as ``benchmarks/engine_throughput.py`` (its helpers: ``--size``, random prompts, ignore_eos,
greedy). ``--adapters`` random LoRA adapters of rank ``--rank`` on every attention and MLP projection, made with peft
(their B matrices non-zero, so that they change the text); request ``i`` runs with adapter ``i mod N``. Rows:

- ``engine, base alone``: the engine without LoRA, every request on the base model.
- ``engine, N adapters mixed``: ``--enable-lora --max-loras N --max-lora-rank R``, every request on its adapter, the
  adapters mixed in every step.
- the same two for vLLM's own build (``vllm_peer.py``, compiled), where it runs; its greedy outputs compared with
  the engine's, request by request.

The ratio that matters is the mixed row's over the base's, system by system.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # lora_helpers: adapters made with peft

from engine_throughput import (
    EngineConfig,
    Row,
    best_round,
    build_tokenizer,
    make_model,
    make_workload,
    print_table,
    run_engine,
    run_vllm,
    same_tokens,
    vllm_python,
)
from lora_helpers import make_adapters

from batchgen.server.engine.features.adapters import Adapters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    parser.add_argument("--quick", action="store_true", help="32 requests, prompts 16-128, outputs 16-64")
    parser.add_argument("--size", default="small", help="the model (engine_throughput.py's --size)")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each row (the best)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache on CPU, each system's")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.prompt_len, args.output_len = 32, (16, 128), (16, 64)
    args.device, args.dtype, args.max_lora_rank = "cpu", "float32", args.rank  # what run_vllm passes on
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    tokenizer = build_tokenizer()
    model = make_model(args.size, "cpu", torch.float32)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    workload = make_workload(args.requests, tuple(args.prompt_len), tuple(args.output_len), args.seed)
    header = (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, {args.threads} CPU threads; "
        f"torch {torch.__version__}; model {params:.0f}M params (float32); {args.requests} requests, prompts "
        f"{args.prompt_len[0]}-{args.prompt_len[1]}, outputs {args.output_len[0]}-{args.output_len[1]} tokens; "
        f"{args.adapters} LoRA adapters of rank {args.rank} on every projection"
    )
    print(header, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        spec = {"r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": targets}
        paths = make_adapters(model_dir, Path(tmp), {f"lora{i}": spec for i in range(args.adapters)})
        modules = tuple(f"{name}={path}" for name, path in paths.items())
        served = Adapters("bench", args.rank, modules)
        names = list(paths)
        loras = [served.get(names[i % len(names)]) for i in range(len(workload))]
        base = EngineConfig(
            device="cpu", dtype="float32", cpu_kv_cache_gib=args.kv_cache_gib,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256,
        )  # fmt: skip
        mixed = dataclasses.replace(
            base, enable_lora=True, lora_modules=modules, max_loras=args.adapters, max_lora_rank=args.rank
        )
        rounds: dict[str, list[Row]] = {}
        outputs: dict[str, list[list[int]]] = {}
        # One system's rounds after the other's: an engine with LoRA puts hooks on the model's linears, one without
        # takes them off, and either way the layers are compiled again (in its warm-up).
        for key, config, requests in (("base", base, None), ("mixed", mixed, loras)):
            run_engine(model, tokenizer, workload[:8], config, requests and requests[:8])  # warm-up (compilation)
            for _ in range(args.rounds):
                row, _, _, outputs[key] = run_engine(model, tokenizer, workload, config, requests)
                rounds.setdefault(key, []).append(row)
        rows = [best_round(rounds["base"]), best_round(rounds["mixed"])]
        rows[0].name, rows[1].name = "engine, base alone", f"engine, {args.adapters} adapters mixed"
        changed = sum(a != b for a, b in zip(outputs["base"], outputs["mixed"], strict=True))
        rows[1].note += f"; {changed}/{len(workload)} outputs differ from the base's"
        print_table("partial", rows, rows[0], True)
        python = None if args.skip_vllm else vllm_python(args.vllm_python)
        vllm_note = "vLLM: skipped" if python is None else ""
        if python is not None:
            try:
                row, tokens = run_vllm(python, model_dir, workload, args, eager=False)
                row.name += ", base alone"
                row.note = same_tokens(outputs["base"], tokens)
                rows.append(row)
                lora_dirs = Path(tmp) / "loras.json"  # each request's adapter, for vllm_peer.py --loras
                lora_dirs.write_text(json.dumps([str(paths[names[i % len(names)]]) for i in range(len(workload))]))
                extra = ("--loras", str(lora_dirs), "--max-lora-rank", str(args.rank))
                row, tokens = run_vllm(python, model_dir, workload, args, eager=False, extra=extra)
                row.name += f", {args.adapters} adapters mixed"
                row.note = same_tokens(outputs["mixed"], tokens)
                rows.append(row)
            except RuntimeError as exc:
                vllm_note = f"vLLM with LoRA failed: {str(exc).splitlines()[-1]}"
    print()
    print(header)
    print_table("LoRA: a mix of adapters against the base alone", rows, rows[0], True)
    for system in range(0, len(rows), 2):
        if system + 1 < len(rows):
            base_row, mixed_row = rows[system], rows[system + 1]
            ratio = mixed_row.tokens_per_second(True) / base_row.tokens_per_second(True)
            print(f"{mixed_row.name}: {ratio:.2f}x the base alone's tokens/CPU s")
    if vllm_note:
        print(vllm_note)


if __name__ == "__main__":
    main()
