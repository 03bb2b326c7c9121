"""batchgen-server: serve runs the Files and Batches REST API; run-batch runs an input file through the engine
offline, without a server or a database.

Only argparse and the settings' declarations are imported before the arguments are parsed: --help answers at once,
and torch loads only when a model does."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from batchgen.schemas.arguments import add_generation_defaults

from .engine.config import EngineConfig
from .options import add_flags, build
from .replicas.config import ClusterConfig
from .serving.config import ServingConfig
from .settings import Settings


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The server's settings: flags given, then BATCHGEN_* variables, then defaults."""
    engine = build(EngineConfig, args)
    problem = engine.usage_problem()
    if problem is not None:
        raise ValueError(problem)
    return build(Settings, args, engine=engine, cluster=build(ClusterConfig, args), serving=build(ServingConfig, args))


def _run_batch(args: argparse.Namespace, settings: Settings) -> int:
    from batchgen.schemas.validation import validate_input_file

    from .engine.errors import ModelLoadError
    from .engine.features.adapters import lora_names
    from .engines import load_engine
    from .run_batch import InvalidInputFile, run_batch
    from .serving import BatchDefaults

    config = settings.engine
    served = (*config.served_model_names, *lora_names(config))
    report = validate_input_file(args.input, family=served)  # before loading a model, which can take minutes
    if not report.ok:
        _print_invalid(args.input, report.errors, report.error_count)
        return 2
    if report.model not in served:
        print(
            f"{args.input}: its requests ask for the model {report.model!r}, which this run does not serve "
            f"({', '.join(map(repr, served))}); nothing was run. Pass --served-model-name "
            f"{report.model!r} to serve --model {config.model!r} under that name.",
            file=sys.stderr,
        )
        return 2
    try:
        engine = load_engine(config, settings.cluster)
    except ModelLoadError as exc:
        print(f"batchgen-server: {exc}", file=sys.stderr)
        return 1
    try:
        summary = run_batch(
            engine,
            args.input,
            args.output,
            args.errors_output,
            BatchDefaults.of(args),
            not args.no_progress,
            settings.serving,
        )
    except InvalidInputFile as exc:  # the file changed after it was validated
        _print_invalid(args.input, exc.errors, len(exc.errors))
        return 2
    print(
        f"{summary.completed}/{summary.total} completed, {summary.failed} failed; "
        f"{summary.prompt_tokens} prompt + {summary.completion_tokens} completion tokens in {summary.seconds:.1f}s",
        file=sys.stderr,
    )
    return 0  # failed requests are reported in the error file, as the Batch API does


def _print_invalid(path: Path, errors: Sequence[object], count: int) -> None:
    print(f"{path}: {count} invalid line(s); nothing was run", file=sys.stderr)
    for error in errors:
        line, code, message = (getattr(error, name) for name in ("line", "code", "message"))
        where = f"line {line}" if line is not None else "file"
        print(f"  {where}: {code}: {message}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchgen-server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('batchgen-server')}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="run the Files and Batches REST API", description="Run the Files and Batches REST API."
    )
    add_flags(serve, Settings, "server")
    add_flags(serve, EngineConfig, "engine")
    add_flags(serve, ClusterConfig, "replicas (docs/scaling.md)")
    add_flags(serve, ServingConfig, "chat outputs: tool calls and reasoning")
    run = commands.add_parser(
        "run-batch",
        help="process a batch input file offline, without the server",
        description="Run a batch input file through the engine into output and error files, without a server.",
    )
    run.add_argument("-i", "--input", type=Path, required=True, help="batch input JSONL")
    run.add_argument("-o", "--output", type=Path, required=True, help="output JSONL (successful requests)")
    run.add_argument("--errors-output", type=Path, default=None, help="error JSONL (default: into --output)")
    add_generation_defaults(run)
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_flags(run, EngineConfig, "engine")
    add_flags(run, ClusterConfig, "replicas (docs/scaling.md)")
    add_flags(run, ServingConfig, "chat outputs: tool calls and reasoning")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:  # a BATCHGEN_* variable that does not parse, or flags that contradict each other
        parser.error(str(exc))
    if args.command == "serve":
        from .serve import serve

        return serve(settings)
    return _run_batch(args, settings)


if __name__ == "__main__":
    sys.exit(main())
