"""The batchgen command: submit and follow batches, list, download and delete files. Human tables, or --json
(errors too).

exit codes:
  0    success
  1    the batch failed, was cancelled or expired, or has no such results file; health: the server is unhealthy
  2    usage error
  3    API error: the server rejected the request
  4    connection error or request timeout
  5    --timeout passed while waiting (the batch keeps running)
  6    submit: the input file has invalid lines (nothing was uploaded)
  141  the output was closed early (`batchgen ... | head`)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import msgspec

from batchgen.schemas import ENDPOINTS, TERMINAL_STATUSES, BatchObject, FileObject, GenerationDefaults
from batchgen.schemas.arguments import add_generation_defaults
from batchgen.schemas.validation import ValidationLimits, validate_input_file

from ._core import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_S, VERSION
from ._sync import BatchGenHttpClient
from .errors import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    BatchOutcomeError,
    BatchWaitTimeoutError,
)

EXIT_OK = 0
EXIT_BATCH_UNSUCCESSFUL = 1
EXIT_USAGE = 2
EXIT_API_ERROR = 3
EXIT_CONNECTION_ERROR = 4
EXIT_WAIT_TIMEOUT = 5
EXIT_INVALID_INPUT = 6
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool that SIGPIPE ended

MAX_SHOWN_ERRORS = 20
"""Line errors printed per input file or failed batch; the count says how many there are in all."""

# Size limits are the server's to enforce (they are configurable there); locally only the content is checked.
_CONTENT_ONLY = ValidationLimits(max_requests=sys.maxsize, max_line_bytes=sys.maxsize, max_file_bytes=sys.maxsize)


class CliError(Exception):
    """A failure to report, with the exit code it ends in: as text, or under ``--json`` in the API's error envelope.

    ``text`` replaces ``message`` for people and ``details`` are extra lines for them; ``extra`` are more envelope
    fields, carrying the same facts for programs.
    """

    def __init__(
        self,
        exit_code: int,
        type: str,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        text: str | None = None,
        details: Sequence[str] = (),
        **extra: Any,
    ) -> None:
        super().__init__(text or message)
        self.exit_code = exit_code
        self.details = details
        self.envelope = {"error": {"message": message, "type": type, "param": param, "code": code, **extra}}


class Output:
    """Writes results (stdout) and errors (stderr) as human text or as JSON, per ``--json``."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def show(self, value: Any, human: Callable[[], str]) -> None:
        print(msgspec.json.encode(value).decode() if self.as_json else human())

    def batch(self, batch: BatchObject) -> None:
        self.show(batch, lambda: _batch_details(batch))

    def error(self, error: CliError) -> None:
        if self.as_json:
            print(msgspec.json.encode(error.envelope).decode(), file=sys.stderr)
        else:
            print(f"batchgen: {error}", *(f"  {line}" for line in error.details), sep="\n", file=sys.stderr)


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
    errors = batch.errors.data if batch.errors else []
    fields += [("error", _line_error(error.line, error.message, error.code)) for error in errors[:MAX_SHOWN_ERRORS]]
    if len(errors) > MAX_SHOWN_ERRORS:
        fields.append(("error", f"... and {len(errors) - MAX_SHOWN_ERRORS} more ({len(errors)} reported)"))
    return _table(["field", "value"], fields)


def _line_error(line: int | None, message: str | None, code: str | None) -> str:
    where = f"line {line}: " if line is not None else ""
    return f"{where}{message}" + (f" ({code})" if code else "")


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
            raise CliError(EXIT_USAGE, "usage_error", f"--metadata expects KEY=VALUE, got {pair!r}", param="metadata")
        metadata[key] = value
    return metadata


def _validated_endpoint(path: Path, endpoint: str | None) -> str:
    """Validate the input file as the server will; its lines' ``url`` gives the endpoint unless one is given."""
    report = validate_input_file(path, endpoint=endpoint, limits=_CONTENT_ONLY, max_errors=MAX_SHOWN_ERRORS)
    if report.ok and report.endpoint is not None:
        return report.endpoint
    shown = [_line_error(error.line, error.message, error.code) for error in report.errors]
    if report.error_count > len(shown):
        shown.append(f"... and {report.error_count - len(shown)} more")
    raise CliError(
        EXIT_INVALID_INPUT,
        "invalid_request_error",
        f"{path}: {report.error_count} error(s) in {report.request_count} request(s); nothing was uploaded",
        code="invalid_input_file",
        param="file",
        details=shown,
        error_count=report.error_count,
        errors=[msgspec.to_builtins(error) for error in report.errors],
    )


def _submit(client: BatchGenHttpClient, args: argparse.Namespace, out: Output) -> int:
    metadata = _metadata(args.metadata)
    batch = client.submit_batch(
        args.file,
        args.output,
        endpoint=_validated_endpoint(args.file, args.endpoint),
        completion_window=args.completion_window,
        metadata=metadata,
        **{name: getattr(args, name) for name in GenerationDefaults.__struct_fields__},
        wait=args.wait,
        poll_interval=args.poll_interval,
        timeout=args.timeout,
        progress=args.progress,
    )
    out.batch(batch)
    if args.output is not None and batch.output_file_id is not None and not out.as_json:
        print(f"results written to {args.output}", file=sys.stderr)
    return EXIT_OK


def _images(client: BatchGenHttpClient, args: argparse.Namespace, out: Output) -> int:
    try:
        batch = client.submit_image_batch(
            args.folder,
            args.prompt,
            model=args.model,
            max_tokens=args.max_tokens,
            output_path=args.output,
            progress=args.progress,
            wait=args.wait,
            poll_interval=args.poll_interval,
            timeout=args.timeout,
            completion_window=args.completion_window,
            **{name: getattr(args, name) for name in GenerationDefaults.__struct_fields__},
        )
    except ValueError as exc:  # no such folder, no images in it
        raise CliError(EXIT_USAGE, "usage_error", str(exc)) from None
    out.batch(batch)
    if args.output is not None and batch.output_file_id is not None and not out.as_json:
        print(f"results written to {args.output}", file=sys.stderr)
    return EXIT_OK


def _no_file(batch: BatchObject, kind: str) -> CliError:
    """Why a batch has no output (or error) file: not yet, never ran, or nothing to put in it."""
    if batch.status not in TERMINAL_STATUSES:
        reason = f"batch {batch.id} is {batch.status}: its {kind} file does not exist yet"
    elif batch.in_progress_at is None and batch.status != "completed":
        reason = f"batch {batch.id} {batch.status} before running any request, so it has no {kind} file"
    else:
        outcome = "succeeded" if kind == "output" else "failed"
        reason = f"batch {batch.id} is {batch.status} and no request {outcome}, so it has no {kind} file"
    return CliError(EXIT_BATCH_UNSUCCESSFUL, "not_found_error", reason, code=f"no_{kind}_file")


def _download(client: BatchGenHttpClient, args: argparse.Namespace, out: Output) -> int:
    file_id = args.id
    if args.id.startswith("batch"):
        batch = client.get_batch(args.id)
        kind = "error" if args.errors else "output"
        file_id = batch.error_file_id if args.errors else batch.output_file_id
        if file_id is None:
            raise _no_file(batch, kind)
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
    if command == "images":
        return _images(client, args, out)
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
    if command == "files":  # the only file action so far: delete
        deleted = client.delete_file(args.id)
        out.show(deleted, lambda: f"{deleted.id} deleted")
        return EXIT_OK
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


class _Parser(argparse.ArgumentParser):
    """Reports usage errors through ``Output``, so that ``--json`` makes them JSON too."""

    def __init__(self, *args: Any, output: Output, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.output = output

    def error(self, message: str) -> NoReturn:
        if not self.output.as_json:
            super().error(message)
        self.output.error(CliError(EXIT_USAGE, "usage_error", message))
        self.exit(EXIT_USAGE)


def _parser(output: Output) -> argparse.ArgumentParser:
    # Connection options are accepted before or after the command; SUPPRESS keeps a sub-parser from resetting them.
    common = _Parser(add_help=False, output=output)
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
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON instead of tables, errors too"
    )

    waiting = _Parser(add_help=False, output=output)
    waiting.add_argument("--poll-interval", type=float, default=2.0, help="seconds between status polls (default 2)")
    waiting.add_argument("--timeout", type=float, default=None, help="give up waiting after this many seconds (exit 5)")
    waiting.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: on a terminal)"
    )

    parser = _Parser(
        prog="batchgen",
        description=__doc__,
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        output=output,
    )
    parser.add_argument("--version", action="version", version=f"batchgen {VERSION}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    command = functools.partial(commands.add_parser, output=output)

    submit = command("submit", parents=[common, waiting], help="upload a JSONL file and start a batch")
    submit.add_argument("file", type=Path, help="JSONL input file (checked before it is uploaded)")
    submit.add_argument("-o", "--output", type=Path, help="write the output file here once the batch completes")
    submit.add_argument("--endpoint", choices=ENDPOINTS, help="default: the url of the file's lines")
    submit.add_argument("--completion-window", default="24h")
    submit.add_argument("--metadata", action="append", metavar="KEY=VALUE", help="batch metadata (repeatable)")
    submit.add_argument(
        "--wait", action=argparse.BooleanOptionalAction, default=True, help="wait for the batch to finish (default)"
    )
    add_generation_defaults(submit)

    images = command("images", parents=[common, waiting], help="a batch asking one prompt of every image in a folder")
    images.add_argument("folder", type=Path, help="PNG, JPEG, WebP and GIF files (each distinct one uploaded once)")
    images.add_argument("--prompt", required=True, help="what each line asks of its image")
    images.add_argument("--model", required=True, help="the served vision-language model")
    images.add_argument("--max-tokens", type=int, default=None, help="most tokens each answer may have")
    images.add_argument("-o", "--output", type=Path, help="write the output file here once the batch completes")
    images.add_argument("--completion-window", default="24h")
    images.add_argument(
        "--wait", action=argparse.BooleanOptionalAction, default=True, help="wait for the batch to finish (default)"
    )
    add_generation_defaults(images)

    for name, parents, help in (
        ("status", [common], "show a batch"),
        ("wait", [common, waiting], "wait for a batch to finish"),
        ("cancel", [common], "cancel a batch"),
    ):
        command(name, parents=parents, help=help).add_argument("id", help="batch id")

    download = command("download", parents=[common], help="download a file, or a batch's output file")
    download.add_argument("id", help="file id, or batch id for its output file")
    download.add_argument("-o", "--output", type=Path, required=True)
    download.add_argument("--errors", action="store_true", help="with a batch id: download its error file instead")

    listing = command("list", parents=[common], help="list batches or files")
    listing.add_argument("what", choices=["batches", "files"])
    listing.add_argument("--limit", type=int, default=None, help="show at most this many (newest first)")
    listing.add_argument("--purpose", help="files: only this purpose (batch, batch_output)")

    files = command("files", help="manage files").add_subparsers(
        dest="action", required=True, metavar="ACTION", parser_class=_Parser
    )
    files.add_parser("delete", parents=[common], help="delete a file", output=output).add_argument("id", help="file id")

    command("models", parents=[common], help="list the served models")
    command("health", parents=[common], help="check the server's health (exit 1 when unhealthy)")
    command("pool", parents=[common], help="show the engine's queue and KV-cache occupancy")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(sys.argv[1:] if argv is None else list(argv))
        finally:
            sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at interpreter exit
    except BrokenPipeError:
        # The reader went away (`batchgen list files | head`): stop quietly, like a tool that SIGPIPE ends.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: list[str]) -> int:
    out = Output("--json" in argv)  # known before parsing, so that usage errors are JSON too
    args = _parser(out).parse_args(argv)
    try:
        with BatchGenHttpClient(
            getattr(args, "base_url", None),
            api_key=getattr(args, "api_key", None),
            timeout_s=getattr(args, "request_timeout", DEFAULT_TIMEOUT_S),
            max_retries=getattr(args, "max_retries", DEFAULT_MAX_RETRIES),
        ) as client:
            return _run(client, args, out)
    except CliError as exc:
        error = exc
    except BatchOutcomeError as exc:
        out.batch(exc.batch)
        # Its errors are in the batch just printed.
        message = f"batch {exc.batch.id} {exc.batch.status}"
        error = CliError(EXIT_BATCH_UNSUCCESSFUL, "batch_error", message, code=exc.batch.status)
    except BatchWaitTimeoutError as exc:
        out.batch(exc.batch)
        error = CliError(EXIT_WAIT_TIMEOUT, "timeout_error", str(exc), code="wait_timeout")
    except APIConnectionError as exc:
        code = "timeout" if isinstance(exc, APITimeoutError) else None
        error = CliError(EXIT_CONNECTION_ERROR, "connection_error", str(exc), code=code)
    except APIStatusError as exc:
        error = CliError(
            EXIT_API_ERROR,
            exc.type or "api_error",
            exc.message,
            text=f"API error {exc}",
            code=exc.code,
            param=exc.param,
            status_code=exc.status_code,
            request_id=exc.request_id,
        )
    except APIError as exc:
        error = CliError(EXIT_API_ERROR, "api_error", exc.message, text=f"API error {exc}", request_id=exc.request_id)
    except BrokenPipeError:
        raise
    except OSError as exc:
        error = CliError(EXIT_USAGE, "usage_error", str(exc))
    out.error(error)
    return error.exit_code
