"""The batchgen command: submit and follow batches, list and download files. Human tables, or --json.

exit codes:
  0  success
  1  the batch failed, was cancelled or expired; health: the server is unhealthy
  2  usage error
  3  API error: the server rejected the request
  4  connection error or request timeout
  5  --timeout passed while waiting (the batch keeps running)
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from batchgen.schemas import BatchObject, FileObject

from ._core import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_S
from ._sync import BatchGenHttpClient
from .errors import APIConnectionError, APIError, BatchOutcomeError, BatchWaitTimeoutError

EXIT_OK = 0
EXIT_BATCH_UNSUCCESSFUL = 1
EXIT_USAGE = 2
EXIT_API_ERROR = 3
EXIT_CONNECTION_ERROR = 4
EXIT_WAIT_TIMEOUT = 5


class Output:
    """Writes results as human tables or as JSON, per ``--json``."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def show(self, value: Any, human: Callable[[], str]) -> None:
        print(msgspec.json.encode(value).decode() if self.as_json else human())

    def batch(self, batch: BatchObject) -> None:
        self.show(batch, lambda: _batch_details(batch))


def _time(timestamp: int | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    cells = [list(headers), *([str(cell) for cell in row] for row in rows)]
    widths = [max(len(row[column]) for row in cells) for column in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _batch_details(batch: BatchObject) -> str:
    counts = batch.request_counts
    fields: list[tuple[str, object]] = [
        ("id", batch.id),
        ("status", batch.status),
        ("endpoint", batch.endpoint),
        ("model", batch.model or "-"),
        ("requests", f"{counts.completed} completed, {counts.failed} failed, {counts.total} total"),
        ("tokens", f"{batch.usage.input_tokens} in, {batch.usage.output_tokens} out"),
        ("input_file_id", batch.input_file_id),
        ("output_file_id", batch.output_file_id or "-"),
        ("error_file_id", batch.error_file_id or "-"),
        ("created_at", _time(batch.created_at)),
        ("completed_at", _time(batch.completed_at)),
    ]
    fields += [
        ("error", f"line {error.line}: {error.message}" if error.line is not None else error.message)
        for error in (batch.errors.data if batch.errors else [])
    ]
    return _table(["field", "value"], fields)


def _batch_rows(batches: Iterable[BatchObject]) -> list[tuple[object, ...]]:
    return [
        (
            batch.id,
            batch.status,
            batch.endpoint,
            f"{batch.request_counts.completed}/{batch.request_counts.failed}/{batch.request_counts.total}",
            _time(batch.created_at),
        )
        for batch in batches
    ]


def _file_rows(files: Iterable[FileObject]) -> list[tuple[object, ...]]:
    return [(file.id, file.purpose, file.bytes, file.filename, _time(file.created_at)) for file in files]


def _metadata(pairs: Sequence[str] | None) -> dict[str, str] | None:
    if not pairs:
        return None
    metadata = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--metadata expects KEY=VALUE, got {pair!r}")
        metadata[key] = value
    return metadata


def _submit(client: BatchGenHttpClient, args: argparse.Namespace, out: Output) -> int:
    batch = client.submit_batch(
        args.file,
        args.output,
        endpoint=args.endpoint,
        completion_window=args.completion_window,
        metadata=_metadata(args.metadata),
        max_decoding_length=args.max_decoding_length,
        max_context_length=args.max_context_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        wait=args.wait,
        poll_interval=args.poll_interval,
        timeout=args.timeout,
        progress=args.progress,
    )
    out.batch(batch)
    if args.output is not None and batch.output_file_id is not None and not out.as_json:
        print(f"results written to {args.output}", file=sys.stderr)
    return EXIT_OK


def _download(client: BatchGenHttpClient, args: argparse.Namespace, out: Output) -> int:
    file_id = args.id
    if args.id.startswith("batch"):
        batch = client.get_batch(args.id)
        file_id = batch.error_file_id if args.errors else batch.output_file_id
        if file_id is None:
            kind = "error" if args.errors else "output"
            print(f"batch {batch.id} ({batch.status}) has no {kind} file yet", file=sys.stderr)
            return EXIT_BATCH_UNSUCCESSFUL
    path = client.download_file(file_id, args.output)
    size = path.stat().st_size
    out.show({"file_id": file_id, "path": str(path), "bytes": size}, lambda: f"{file_id}: {size} bytes -> {path}")
    return EXIT_OK


def _list(client: BatchGenHttpClient, args: argparse.Namespace, out: Output) -> int:
    if args.what == "batches":
        batches = list(itertools.islice(client.list_batches(), args.limit))
        out.show(
            batches, lambda: _table(["id", "status", "endpoint", "done/failed/total", "created"], _batch_rows(batches))
        )
    else:
        files = list(itertools.islice(client.list_files(purpose=args.purpose), args.limit))
        out.show(files, lambda: _table(["id", "purpose", "bytes", "filename", "created"], _file_rows(files)))
    return EXIT_OK


def _run(client: BatchGenHttpClient, args: argparse.Namespace, out: Output) -> int:
    command: str = args.command
    if command == "submit":
        return _submit(client, args, out)
    if command == "status":
        out.batch(client.get_batch(args.id))
        return EXIT_OK
    if command == "cancel":
        out.batch(client.cancel_batch(args.id))
        return EXIT_OK
    if command == "wait":
        out.batch(
            client.wait_for_batch(
                args.id, poll_interval=args.poll_interval, timeout=args.timeout, progress=args.progress
            )
        )
        return EXIT_OK
    if command == "download":
        return _download(client, args, out)
    if command == "list":
        return _list(client, args, out)
    if command == "models":
        models = client.list_models().data
        out.show(
            models,
            lambda: _table(
                ["id", "max_context_length", "owned_by"], [(m.id, m.max_context_length, m.owned_by) for m in models]
            ),
        )
        return EXIT_OK
    if command == "pool":
        pool = client.pool_status()
        out.show(pool, lambda: _table(["field", "value"], msgspec.structs.asdict(pool).items()))
        return EXIT_OK
    health = client.health_check()
    out.show(health, lambda: health.status + (f": {health.reason}" if health.reason else ""))
    return EXIT_OK if health.status == "healthy" else EXIT_BATCH_UNSUCCESSFUL


def _parser() -> argparse.ArgumentParser:
    # Connection options are accepted before or after the command; SUPPRESS keeps a sub-parser from resetting them.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--base-url",
        default=argparse.SUPPRESS,
        help="server URL (default $BATCHGEN_BASE_URL or http://localhost:10900)",
    )
    common.add_argument("--api-key", default=argparse.SUPPRESS, help="API key (default $BATCHGEN_API_KEY)")
    common.add_argument(
        "--request-timeout", type=float, default=argparse.SUPPRESS, help="seconds per HTTP request (default 600)"
    )
    common.add_argument(
        "--max-retries", type=int, default=argparse.SUPPRESS, help="retries of a failed request (default 2)"
    )
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON instead of tables")

    waiting = argparse.ArgumentParser(add_help=False)
    waiting.add_argument("--poll-interval", type=float, default=2.0, help="seconds between status polls (default 2)")
    waiting.add_argument("--timeout", type=float, default=None, help="give up waiting after this many seconds (exit 5)")
    waiting.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: on a terminal)"
    )

    parser = argparse.ArgumentParser(
        prog="batchgen", description=__doc__, parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    submit = commands.add_parser("submit", parents=[common, waiting], help="upload a JSONL file and start a batch")
    submit.add_argument("file", type=Path, help="JSONL input file")
    submit.add_argument("-o", "--output", type=Path, help="write the output file here once the batch completes")
    submit.add_argument(
        "--endpoint",
        default="/v1/chat/completions",
        choices=["/v1/chat/completions", "/v1/completions", "/v1/embeddings"],
    )
    submit.add_argument("--completion-window", default="24h")
    submit.add_argument("--metadata", action="append", metavar="KEY=VALUE", help="batch metadata (repeatable)")
    submit.add_argument("--max-decoding-length", type=int, help="batch-level default max output tokens")
    submit.add_argument("--max-context-length", type=int, help="batch-level max prompt + output tokens")
    submit.add_argument("--temperature", type=float)
    submit.add_argument("--top-p", type=float)
    submit.add_argument("--top-k", type=int)
    submit.add_argument(
        "--wait", action=argparse.BooleanOptionalAction, default=True, help="wait for the batch to finish (default)"
    )

    for name, parents, help in (
        ("status", [common], "show a batch"),
        ("wait", [common, waiting], "wait for a batch to finish"),
        ("cancel", [common], "cancel a batch"),
    ):
        commands.add_parser(name, parents=parents, help=help).add_argument("id", help="batch id")

    download = commands.add_parser("download", parents=[common], help="download a file, or a batch's output file")
    download.add_argument("id", help="file id, or batch id for its output file")
    download.add_argument("-o", "--output", type=Path, required=True)
    download.add_argument("--errors", action="store_true", help="with a batch id: download its error file instead")

    listing = commands.add_parser("list", parents=[common], help="list batches or files")
    listing.add_argument("what", choices=["batches", "files"])
    listing.add_argument("--limit", type=int, default=None, help="show at most this many (newest first)")
    listing.add_argument("--purpose", help="files: only this purpose (batch, batch_output)")

    commands.add_parser("models", parents=[common], help="list the served models")
    commands.add_parser("health", parents=[common], help="check the server's health (exit 1 when unhealthy)")
    commands.add_parser("pool", parents=[common], help="show the engine's queue and KV-cache occupancy")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    out = Output(getattr(args, "json", False))
    try:
        with BatchGenHttpClient(
            getattr(args, "base_url", None),
            api_key=getattr(args, "api_key", None),
            timeout_s=getattr(args, "request_timeout", DEFAULT_TIMEOUT_S),
            max_retries=getattr(args, "max_retries", DEFAULT_MAX_RETRIES),
        ) as client:
            return _run(client, args, out)
    except argparse.ArgumentTypeError as exc:
        parser.print_usage(sys.stderr)
        print(f"batchgen: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BatchOutcomeError as exc:
        out.batch(exc.batch)
        print(f"batchgen: {exc}", file=sys.stderr)
        return EXIT_BATCH_UNSUCCESSFUL
    except BatchWaitTimeoutError as exc:
        out.batch(exc.batch)
        print(f"batchgen: {exc}", file=sys.stderr)
        return EXIT_WAIT_TIMEOUT
    except APIConnectionError as exc:
        print(f"batchgen: {exc}", file=sys.stderr)
        return EXIT_CONNECTION_ERROR
    except APIError as exc:
        print(f"batchgen: API error {exc}", file=sys.stderr)
        return EXIT_API_ERROR
    except OSError as exc:
        print(f"batchgen: {exc}", file=sys.stderr)
        return EXIT_USAGE
