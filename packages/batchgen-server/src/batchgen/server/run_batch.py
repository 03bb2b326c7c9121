"""Offline batch: an OpenAI batch input file straight through the engine (no HTTP) to output/error files."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import msgspec
from tqdm import tqdm

from batchgen.schemas import BatchInputLine, BatchOutputLine
from batchgen.schemas.validation import LineError, ValidationReport, iter_input_lines, validate_input_file

from .engine import EncoderEngine, EngineResult, LLMEngine
from .serving import BatchDefaults, OpenAIServing, RequestRejected


class InvalidInputFile(Exception):
    """The input file failed validation (as the server would fail the batch); nothing was run."""

    def __init__(self, report: ValidationReport) -> None:
        super().__init__(f"{report.error_count} invalid line(s)")
        self.report = report


@dataclass
class RunBatchSummary:
    total: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0


@dataclass
class _Pending:
    line: BatchInputLine
    request_id: str
    expected: int
    results: list[EngineResult] = field(default_factory=list)


def run_batch(
    engine: LLMEngine | EncoderEngine,
    input_path: Path,
    output_path: Path,
    errors_path: Path | None = None,
    defaults: BatchDefaults | None = None,
    progress: bool = True,
    report: ValidationReport | None = None,
) -> RunBatchSummary:
    """Validate the whole file first (``InvalidInputFile`` if it fails, like the server), then run every line.

    Successes go to ``output_path``, requests that fail (unsupported parameters, prompts over the context) to
    ``errors_path`` (or the output when unset). Lines are read lazily and only a few steps' worth are in flight, so
    memory stays flat on huge files. ``report`` is the file's validation when the caller already has it.
    """
    report = report or validate_input_file(input_path)
    if not report.ok:
        raise InvalidInputFile(report)
    defaults = defaults or BatchDefaults()
    serving = OpenAIServing(engine.tokenizer, engine.model_name, engine.max_context_length, engine.tasks)
    group = f"run-batch-{uuid.uuid4().hex[:8]}"
    in_flight_limit = 4 * engine.config.max_num_seqs
    summary = RunBatchSummary(total=report.request_count)
    encoder = msgspec.json.Encoder()
    pending: dict[str, _Pending] = {}
    owner: dict[str, str] = {}  # engine request id -> line request id
    start = time.monotonic()
    with (
        output_path.open("wb") as output,
        errors_path.open("wb") if errors_path else _nullcontext(output) as errors,
        tqdm(total=summary.total, unit="req", disable=not progress, dynamic_ncols=True) as bar,
    ):

        def write(out: IO[bytes], line: BatchOutputLine, ok: bool) -> None:
            out.write(encoder.encode(line) + b"\n")
            summary.completed += ok
            summary.failed += not ok
            bar.update(1)
            elapsed = time.monotonic() - start
            bar.set_postfix_str(f"{summary.completion_tokens / max(elapsed, 1e-9):,.0f} tok/s", refresh=False)

        lines = iter_input_lines(input_path)
        exhausted = False
        while True:
            while not exhausted and len(owner) < in_flight_limit:
                line = next(lines, None)
                if line is None:
                    exhausted = True
                    break
                if isinstance(line, LineError):  # the file changed since it was validated
                    raise InvalidInputFile(
                        ValidationReport(request_count=0, error_count=1, errors=[line], model=None, endpoint=None)
                    )
                request_id = f"req_{uuid.uuid4().hex}"
                try:
                    requests = serving.to_engine_requests(line, request_id=request_id, defaults=defaults, group=group)
                except RequestRejected as exc:
                    rejected = serving.error_line(
                        line.custom_id, request_id=request_id, code=exc.code, message=exc.message, param=exc.param
                    )
                    write(errors, rejected, ok=False)
                    continue
                pending[request_id] = _Pending(line, request_id, len(requests))
                for request in requests:
                    owner[request.request_id] = request_id
                    engine.add_request(request)
            if not engine.has_unfinished_requests():
                break
            for result in engine.step():
                item = pending[owner.pop(result.request_id)]
                item.results.append(result)
                summary.prompt_tokens += result.prompt_tokens
                summary.completion_tokens += result.completion_tokens
                if len(item.results) == item.expected:
                    del pending[item.request_id]
                    out_line = serving.output_line(item.line, item.results, request_id=item.request_id)
                    ok = out_line.response is not None and out_line.response.status_code == 200
                    write(output if ok else errors, out_line, ok)
    summary.seconds = time.monotonic() - start
    return summary


class _nullcontext:
    """Use an already open file as a context manager without closing it."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file

    def __enter__(self) -> IO[bytes]:
        return self.file

    def __exit__(self, *exc: object) -> None:
        return None
