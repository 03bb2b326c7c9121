"""Scoring through lm-evaluation-harness: batchgen's server against lm-eval's own ``hf`` backend (the same numbers)
and against vLLM's server (the speed), on the same model and tasks.

    python benchmarks/scoring.py                      # parity, then loglikelihood items/s: batchgen vs vLLM
    python benchmarks/scoring.py --docs 20 --no-vllm  # parity only, quickly

Needs ``lm-eval`` (0.4.13) in this environment; vLLM's CPU build in its own virtualenv (``--vllm-python``, default
``$BATCHGEN_VLLM_PYTHON``, else ``/work/vllm-venv/bin/python``; skipped with a note when there is none).

Model: engine_throughput's ``--size`` (``small``: 6 layers, hidden 384, head_dim 64, the 32,000-token head; vLLM
needs head_dim >= 32), random weights, the demo's byte-level tokenizer, saved to a temporary directory. Tasks, local
(no hub): a multiple-choice task of ``--docs`` questions with 4 choices each (random text contexts of 60-200
characters, continuations of 5-40; the answer drawn at random) and a ``generate_until`` task of 8 prompts (16 tokens
at most, stopping at a newline).

Parity (asserted): through ``local-completions`` against batchgen's server (``echo``, ``logprobs: 1``,
``max_tokens: 1``, what lm-eval sends for every loglikelihood), every item's loglikelihood within 1e-3 of lm-eval's
``hf`` backend on the same model (float32), the same ``is_greedy`` and the same accuracy, and identical greedy
continuations for the generate task.

Speed: the multiple-choice task through ``local-completions`` (``--batch-size`` prompts a request,
``--concurrency`` requests at once) against batchgen's server and ``vllm serve`` with the same flags where they have
them (float32, ``--max-num-batched-tokens``, ``--threads`` torch threads, prefix caching on: both skip it for
prompt-logprob requests). Loglikelihood items per second of wall time, after a warm-up pass of the same task, and
the server process's CPU seconds (on shared cores the steadier figure).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import string
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import SIZES, make_model, vllm_python

from batchgen.server.engine.loading.demo_model import build_tokenizer
from batchgen.server.launcher import ServerProcess, free_port

SERVED_NAME = "scoring-bench"
TOLERANCE = 1e-3


def save_model(size: str, path: Path) -> None:
    import torch

    make_model(size, "cpu", torch.float32).save_pretrained(path)
    build_tokenizer().save_pretrained(path)


def write_tasks(directory: Path, docs: int, seed: int) -> tuple[str, str]:
    """A multiple-choice task and a generate_until task over local jsonl files; their names."""
    rng = random.Random(seed)
    alphabet = string.ascii_lowercase + "      ,."

    def text(low: int, high: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(low, high))).strip() or "x"

    mc = [
        {"question": text(60, 200), "choices": [" " + text(5, 40) for _ in range(4)], "answer": rng.randrange(4)}
        for _ in range(docs)
    ]
    gen = [{"question": text(20, 80), "answer": ""} for _ in range(8)]
    for name, rows in (("mc", mc), ("gen", gen)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
    (directory / "scoring_mc.yaml").write_text(
        f"task: scoring_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\nmetric_list:\n  - metric: acc\n"
    )
    (directory / "scoring_gen.yaml").write_text(
        f"task: scoring_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'gen.jsonl'}\n"
        "output_type: generate_until\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 16\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return "scoring_mc", "scoring_gen"


def evaluate(
    model: str, model_args: str, task: str, tasks_dir: Path, limit: int | None = None
) -> tuple[dict[str, Any], list[Any], float]:
    """lm-eval on one task: its metrics, its per-document samples (in document order), and the wall seconds of its
    requests alone (the model's ``loglikelihood`` or ``generate_until``: not loading the task or the model)."""
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    model_class = get_model(model)
    spent: list[float] = []
    originals = {name: getattr(model_class, name) for name in ("loglikelihood", "generate_until")}

    def timed(name: str) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return originals[name](self, *args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)

        return run

    for name in originals:
        setattr(model_class, name, timed(name))
    try:
        out = lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=[task],
            task_manager=TaskManager(include_path=str(tasks_dir)),
            log_samples=True,
            cache_requests=False,
            verbosity="ERROR",
            limit=limit,
        )
    finally:
        for name, original in originals.items():
            setattr(model_class, name, original)
    seconds = sum(spent)
    samples = sorted(out["samples"][task], key=lambda sample: sample["doc_id"])
    return out["results"][task], samples, seconds


def completions_args(base_url: str, model_dir: Path, args: argparse.Namespace) -> str:
    return (
        f"model={SERVED_NAME},base_url={base_url}/v1/completions,tokenizer={model_dir},tokenizer_backend=huggingface,"
        f"tokenized_requests=True,num_concurrent={args.concurrency},batch_size={args.batch_size},max_retries=1,"
        "timeout=3600"
    )


def loglikelihoods(samples: list[Any]) -> list[tuple[float, bool]]:
    return [(float(ll), bool(greedy)) for sample in samples for ll, greedy in (r[0] for r in sample["resps"])]


def continuations(samples: list[Any]) -> list[str]:
    return [sample["resps"][0][0] for sample in samples]


def compare(name: str, ours: list[tuple[float, bool]], reference: list[tuple[float, bool]]) -> float:
    """The largest loglikelihood difference; asserts the tolerance and the same is_greedy."""
    assert len(ours) == len(reference), (name, len(ours), len(reference))
    worst = max(abs(a[0] - b[0]) for a, b in zip(ours, reference, strict=True))
    assert worst <= TOLERANCE, f"{name}: a loglikelihood differs from the hf backend's by {worst:.2e}"
    greedy = sum(a[1] == b[1] for a, b in zip(ours, reference, strict=True))
    assert greedy == len(ours), f"{name}: is_greedy differs on {len(ours) - greedy} items"
    return worst


def cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its children (vLLM's engine core runs in one)."""
    process = psutil.Process(pid)
    total = sum(process.cpu_times()[:2])
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += sum(child.cpu_times()[:2])
    return total


def timed_run(pid: int, model_args: str, task: str, tasks_dir: Path) -> tuple[dict[str, Any], list[Any], float, float]:
    """A few documents to warm up, then the task timed: metrics, samples, wall seconds, the server's CPU seconds."""
    evaluate("local-completions", model_args, task, tasks_dir, limit=4)
    before = cpu_seconds(pid)
    metrics, samples, seconds = evaluate("local-completions", model_args, task, tasks_dir)
    return metrics, samples, seconds, cpu_seconds(pid) - before


class VllmServer:
    """``vllm serve`` in vLLM's own virtualenv, on a free port, until stopped."""

    def __init__(
        self, python: Path, model_dir: Path, args: argparse.Namespace, log: Path, extra: tuple[str, ...] = ()
    ) -> None:
        """``extra``: more ``vllm serve`` flags (``--runner pooling``...)."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": "2"}
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else "all"
        env.pop("PYTHONPATH", None)
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        command += ["--served-model-name", SERVED_NAME, "--port", str(self.port), "--dtype", "float32"]
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-model-len", "4096", *extra]
        self._log = log.open("wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}: see {log}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"vllm serve not healthy after 900 s: see {log}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="small")
    parser.add_argument("--docs", type=int, default=50, help="multiple-choice questions (4 items each)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per request (lm-eval's batch_size)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests at once (lm-eval's num_concurrent)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = tmp / "model"
        save_model(args.size, model_dir)
        mc, gen = write_tasks(tmp, args.docs, args.seed)
        items = 4 * args.docs

        hf_args = f"pretrained={model_dir},dtype=float32,device=cpu,batch_size=16"
        hf_metrics, hf_samples, hf_seconds = evaluate("hf", hf_args, mc, tmp)
        _, hf_gen, _ = evaluate("hf", hf_args, gen, tmp)
        rows: list[tuple[str, float, float | None, str]] = [
            ("lm-eval hf backend (in process, batch 16)", hf_seconds, None, "")
        ]

        flags = ["--served-model-name", SERVED_NAME, "--dtype", "float32", "--torch-threads", str(args.threads)]
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--cpu-kv-cache-gib", "2"]
        with ServerProcess(tmp / "batchgen", *flags, model=str(model_dir), startup_timeout_s=600) as server:
            assert server.process is not None
            ours_args = completions_args(server.base_url, model_dir, args)
            ours_metrics, samples, seconds, cpu = timed_run(server.process.pid, ours_args, mc, tmp)
            _, ours_gen, _ = evaluate("local-completions", ours_args, gen, tmp)
        worst = compare("batchgen", loglikelihoods(samples), loglikelihoods(hf_samples))
        assert ours_metrics["acc,none"] == hf_metrics["acc,none"], (ours_metrics, hf_metrics)
        assert continuations(ours_gen) == continuations(hf_gen), (continuations(ours_gen), continuations(hf_gen))
        parity = (
            f"{items} items within {worst:.1e} of hf, same is_greedy, acc {ours_metrics['acc,none']:.3f} = hf's; "
            f"{len(ours_gen)} greedy continuations identical"
        )
        rows.append(("batchgen server (local-completions)", seconds, cpu, parity))
        print(f"measured: {rows}", flush=True)  # a long vLLM start may outlast the machine's patience

        python = None if args.no_vllm else vllm_python(args.vllm_python)
        if python is not None:
            vllm = VllmServer(python, model_dir, args, tmp / "vllm.log")
            try:
                vllm_args = completions_args(vllm.base_url, model_dir, args)
                _, vllm_samples, seconds, cpu = timed_run(vllm.process.pid, vllm_args, mc, tmp)
            finally:
                vllm.stop()
            theirs = loglikelihoods(vllm_samples)
            worst_vllm = max(abs(a[0] - b[0]) for a, b in zip(theirs, loglikelihoods(hf_samples), strict=True))
            rows.append(("vLLM server (local-completions)", seconds, cpu, f"items within {worst_vllm:.1e} of hf"))
        elif not args.no_vllm:
            print("vLLM: no interpreter found (--vllm-python, $BATCHGEN_VLLM_PYTHON, /work/vllm-venv): row skipped")

    print(
        f"\nlm-eval loglikelihood, {items} items ({args.docs} questions x 4 choices), model {args.size}, float32, "
        f"batch {args.batch_size} x {args.concurrency} concurrent, {args.threads} torch thread(s)\n"
    )
    print("| system | wall s | items/s | server CPU s | items/CPU-s | note |\n|---|---|---|---|---|---|")
    for name, seconds, cpu, note in rows:
        per_cpu = "-" if cpu is None else f"{items / cpu:.1f}"
        cpu_text = "-" if cpu is None else f"{cpu:.1f}"
        print(f"| {name} | {seconds:.1f} | {items / seconds:.1f} | {cpu_text} | {per_cpu} | {note} |")


if __name__ == "__main__":
    main()
