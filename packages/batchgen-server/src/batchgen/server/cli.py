"""``batchgen-server``: ``serve`` (the REST API) and ``run-batch`` (offline, no HTTP)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from batchgen.schemas.validation import ValidationReport, validate_input_file

from .engine import EngineConfig


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's knobs as flags (shared by every subcommand that runs a model); see docs/engine.md."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default="demo", help="'demo' (tiny random model), a local path or a hub id")
    group.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    group.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, ...")
    group.add_argument("--device-map", default=None, help="'auto' to spread a large model over devices")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (default: from free memory)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--cpu-kv-cache-gib", type=float, default=1.0, help="KV cache size on CPU")
    group.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    group.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    group.add_argument("--max-model-len", type=int, default=None, help="context cap (default: the model's)")
    group.add_argument("--seed", type=int, default=0, help="seed of requests that set none")
    group.add_argument(
        "--torch-threads", type=int, default=None, help="CPU threads of torch's ops (default: torch's, the cores)"
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        device_map=args.device_map,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_gib=args.cpu_kv_cache_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len,
        seed=args.seed,
        torch_threads=args.torch_threads,
    )


def _run_batch(args: argparse.Namespace) -> int:
    from .engine import LLMEngine
    from .run_batch import InvalidInputFile, run_batch
    from .serving import BatchDefaults

    report = validate_input_file(args.input)  # before loading a model, which can take minutes
    if not report.ok:
        _print_invalid(args.input, report)
        return 2
    engine = LLMEngine.from_config(engine_config_from_args(args))
    defaults = BatchDefaults.of(args)
    try:
        summary = run_batch(
            engine, args.input, args.output, args.errors_output, defaults, not args.no_progress, report=report
        )
    except InvalidInputFile as exc:  # the file changed after it was validated
        _print_invalid(args.input, exc.report)
        return 2
    print(
        f"{summary.completed}/{summary.total} completed, {summary.failed} failed; "
        f"{summary.prompt_tokens} prompt + {summary.completion_tokens} completion tokens in {summary.seconds:.1f}s",
        file=sys.stderr,
    )
    return 0  # failed requests are reported in the error file, as the Batch API does


def _serve(args: argparse.Namespace) -> int:
    from .serve import serve, settings_from_args

    return serve(settings_from_args(args, engine_config_from_args(args)), log_level=args.log_level)


def _print_invalid(path: Path, report: ValidationReport) -> None:
    print(f"{path}: {report.error_count} invalid line(s); nothing was run", file=sys.stderr)
    for error in report.errors:
        where = f"line {error.line}" if error.line is not None else "file"
        print(f"  {where}: {error.code}: {error.message}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchgen-server", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    from .serve import add_serve_arguments

    serve = commands.add_parser("serve", help="run the Files and Batches REST API (settings also from BATCHGEN_*)")
    add_serve_arguments(serve)
    add_engine_arguments(serve)
    serve.set_defaults(func=_serve, model=os.environ.get("BATCHGEN_MODEL", "demo"))
    run = commands.add_parser("run-batch", help="process an OpenAI batch input file offline, without the server")
    run.add_argument("-i", "--input", type=Path, required=True, help="batch input JSONL")
    run.add_argument("-o", "--output", type=Path, required=True, help="output JSONL (successful requests)")
    run.add_argument("--errors-output", type=Path, default=None, help="error JSONL (default: into --output)")
    run.add_argument("--max-decoding-length", type=int, default=None, help="default max tokens per request")
    run.add_argument("--max-context-length", type=int, default=None, help="cap on prompt + generated tokens")
    run.add_argument("--temperature", type=float, default=None, help="default temperature (unset: greedy)")
    run.add_argument("--top-p", type=float, default=None)
    run.add_argument("--top-k", type=int, default=None)
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_arguments(run)
    run.set_defaults(func=_run_batch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
