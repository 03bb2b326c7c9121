"""Tensor and pipeline parallelism on CPU: resident weight bytes per rank, and generated tokens per wall second of a
model split over 2 ranks (1 thread each: by heads, TP=2, or by layers, PP=2) against 1 rank (2 threads, and 1), on a
1B-shaped random Llama.

    python benchmarks/tensor_parallel.py                       # hidden 2048, 16 layers, 32/8 heads: ~0.97B params
    python benchmarks/tensor_parallel.py --layers 4 --tokens 8  # shorter
    python benchmarks/tensor_parallel.py --family qwen3_5 --layers 8 --vllm ''  # hybrid: its state split by heads

``--family qwen3_5`` saves a Qwen3.5-shaped hybrid instead (three Gated DeltaNet layers to one of attention, 16 key
and 32 value heads of 128), and the table adds each rank's recurrent state per sequence: split by heads at TP=2
(``engine/features/state/heads.py``), by layers at PP=2.

The model (Llama 3.2 1B's layer shapes, the demo tokenizer's vocabulary, so the embedding is tiny) is saved once as
float32. Each configuration runs in a process of its own through ``build_engine`` (the server's path, the self-check
included): ``--seqs`` greedy sequences of 16-token prompts, ``--tokens`` new tokens each, timed after a first round.
Every configuration runs eagerly (a split model does: its collectives sit between the layers' ops), so the rows
differ by the split alone; a last row runs 1 rank with its fast paths (compiled layers, packed linears) when
``--fast`` is given. The all-reduce's share is the driver's time inside ``torch.distributed.all_reduce`` (the
row-wise layers' sums) over its decode steps' wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-server" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-schemas" / "src"))

CONFIGS = [
    ("TP=1, 1 thread", 1, 1, 1),
    ("TP=1, 2 threads", 1, 1, 2),
    ("TP=2, 1 thread per rank", 2, 1, 1),
    ("PP=2, 1 thread per rank", 1, 2, 1),
]
"""name, --tensor-parallel-size, --pipeline-parallel-size, threads per rank."""


def save_model(path: Path, layers: int, family: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from batchgen.server.engine.loading.demo_model import build_tokenizer

    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    shape: dict[str, object] = {"num_attention_heads": 32, "num_key_value_heads": 8}
    if family == "qwen3_5":  # Qwen3.5's text model at this width
        shape = {
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4 + 1),
        }  # fmt: skip
        shape["layer_types"] = shape["layer_types"][:layers]  # type: ignore[index]
    config = AutoConfig.for_model(
        "qwen3_5_text" if family == "qwen3_5" else "llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=layers,
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        bos_token_id=vocab["<|bos|>"],
        eos_token_id=vocab["<|eos|>"],
        tie_word_embeddings=True,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.02)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def child(model: str, tp: int, pp: int, threads: int, seqs: int, tokens: int, fast: bool) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams, build_engine

    torch.set_num_threads(threads)
    config = EngineConfig(
        model=model,
        dtype="float32",
        device="cpu",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        torch_threads=threads,
        enforce_eager=not fast,
        num_kv_blocks=256,
        distributed_timeout_s=300,
    )
    engine = build_engine(config)
    assert isinstance(engine, LLMEngine)
    weights = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
        for p in engine.runner.model.parameters()
    )
    rss = {"driver": _rss("self")}
    if engine.runner.group is not None:
        for rank, process in enumerate(engine.runner.group.processes, start=1):  # type: ignore[attr-defined]
            rss[f"rank {rank}"] = _rss(str(process.process.pid))  # (mp's ranks: their subprocess)
    reduce_s = [0.0]
    if tp > 1:
        all_reduce = dist.all_reduce

        def timed(*args: object, **kwargs: object) -> object:
            began = time.perf_counter()
            try:
                return all_reduce(*args, **kwargs)  # type: ignore[arg-type]
            finally:
                reduce_s[0] += time.perf_counter() - began

        dist.all_reduce = timed  # type: ignore[assignment]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)

    def run(tag: str) -> tuple[float, float, float, list[list[int]]]:
        for i in range(seqs):
            engine.add_request(EngineRequest(f"{tag}{i}", [(i * 7 + j) % 256 for j in range(16)], params))
        results = {}
        began, decode_s, decode_reduce = time.perf_counter(), 0.0, 0.0
        while engine.has_unfinished_requests():
            prefilling = bool(engine.scheduler.waiting) or any(
                seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running
            )
            step_began, reduce_before = time.perf_counter(), reduce_s[0]
            for result in engine.step():
                results[result.request_id] = result
            if not prefilling and engine.scheduler.running:
                decode_s += time.perf_counter() - step_began
                decode_reduce += reduce_s[0] - reduce_before
        wall = time.perf_counter() - began
        outputs = [results[f"{tag}{i}"].outputs[0].token_ids for i in range(seqs)]
        return wall, decode_s, decode_reduce, outputs

    run("warm")
    wall, decode_s, decode_reduce, outputs = run("timed")
    if engine.runner.group is not None:
        engine.runner.group.stop()  # type: ignore[attr-defined]
    states = engine.runner.states
    return {
        "state": states.slot_bytes if states is not None else 0,
        "weights": weights,
        "rss": rss,
        "rate": seqs * tokens / wall,
        "reduce_share": decode_reduce / decode_s if decode_s else 0.0,
        "outputs": outputs,
    }


def vllm_row(python: Path, model: Path, args: argparse.Namespace, reference: object) -> dict[str, object] | None:
    """vLLM's CPU build on the same model and workload at TP=2 (``vllm_peer.py``, its mp backend), or ``None`` with
    why on stderr."""
    workload = [[[(i * 7 + j) % 256 for j in range(16)], args.tokens] for i in range(args.seqs)]
    with tempfile.TemporaryDirectory() as tmp:
        workload_path, out_path = Path(tmp) / "workload.json", Path(tmp) / "out.json"
        workload_path.write_text(json.dumps(workload))
        command = [str(python), str(Path(__file__).with_name("vllm_peer.py")), str(model), str(workload_path)]
        command += [str(out_path), "--threads", "1", "--eager", "--tensor-parallel-size", "2", "--kv-cache-gib", "1"]
        command += ["--max-model-len", "2048"]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        }
        env.pop("PYTHONPATH", None)  # vLLM's own packages only
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.vllm_timeout)
        except subprocess.TimeoutExpired:
            print(f"vLLM at TP=2 did not finish within {args.vllm_timeout} s", file=sys.stderr)
            return None
        if done.returncode:
            print(f"vLLM at TP=2 failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            return None
        result = json.loads(out_path.read_text())
    tokens = result["tokens"]
    return {
        "weights": 0,
        "rss": {},
        "rate": sum(map(len, tokens)) / result["wall"],
        "reduce_share": 0.0,
        "outputs": tokens,
        "same": reference is None or tokens == reference,
    }


def _rss(pid: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--family", choices=["llama", "qwen3_5"], default="llama")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--fast", action="store_true", help="a last row: 1 rank, 2 threads, its fast paths on")
    parser.add_argument("--vllm", default="/work/vllm-venv/bin/python", help="vLLM's interpreter ('' to skip)")
    parser.add_argument("--vllm-timeout", type=int, default=900)
    parser.add_argument("--vllm-only", action="store_true", help="vLLM's row alone (its tokens then unchecked)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, tp, pp, threads, fast = json.loads(args.child)
        print(json.dumps(child(model, tp, pp, threads, args.seqs, args.tokens, fast)))
        return
    configs = [(*config, False) for config in CONFIGS] + (
        [("TP=1, 2 threads, fast paths", 1, 1, 2, True)] if args.fast else []
    )
    load_before = " ".join(Path("/proc/loadavg").read_text().split()[:3])  # the machine may be shared
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{args.family}-shaped"
        began = time.perf_counter()
        save_model(path, args.layers, args.family)
        print(f"model saved in {time.perf_counter() - began:.0f} s", file=sys.stderr)
        rows, reference = [], None
        for name, tp, pp, threads, fast in [] if args.vllm_only else configs:
            command = [sys.executable, __file__, "--seqs", str(args.seqs), "--tokens", str(args.tokens)]
            out = subprocess.run(
                [*command, "--child", json.dumps([str(path), tp, pp, threads, fast])], capture_output=True, text=True
            )
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                rows.append((name, None))
                continue
            result = json.loads(out.stdout.strip().splitlines()[-1])
            reference = reference or result["outputs"]
            result["same"] = result["outputs"] == reference
            rows.append((name, result))
        if args.vllm and Path(args.vllm).exists():
            row = vllm_row(Path(args.vllm), path, args, reference)
            rows.append(("vLLM CPU, TP=2, 1 thread per rank (enforce_eager)", row))
    base = next((r["rate"] for _, r in rows if r), 1.0)
    print(f"load average before: {load_before}, after: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    hybrid = args.family != "llama"
    print(
        "| configuration | weight MiB per rank | "
        + ("state KiB per sequence per rank | " if hybrid else "")
        + "RSS MiB per process | generated tok/wall-s | vs TP=1 x 1 | all-reduce share of a decode step | "
        "tokens as TP=1 |"
    )
    print("|---|---:|" + ("---:|" if hybrid else "") + "---|---:|---:|---:|---|")
    for name, r in rows:
        if r is None:
            print(f"| {name} | - | " + ("- | " if hybrid else "") + "- | failed | - | - | - |")
            continue
        cells = [name, f"{r['weights'] / 2**20:.0f}" if r["weights"] else "-"]
        if hybrid:
            cells.append(f"{r['state'] / 2**10:.0f}")
        rss = ", ".join(f"{who} {value / 2**20:.0f}" for who, value in r["rss"].items()) or "-"
        share = f"{100 * r['reduce_share']:.0f}%" if r["reduce_share"] else "-"
        cells += [rss, f"{r['rate']:.2f}", f"{r['rate'] / base:.2f}x", share]
        print("| " + " | ".join([*cells, "identical" if r["same"] else "DIFFERENT"]) + " |")


if __name__ == "__main__":
    main()
