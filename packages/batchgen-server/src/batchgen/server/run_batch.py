"""Offline batch: an OpenAI batch input file straight through the engine (no HTTP) to output/error files."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import msgspec
from tqdm import tqdm

from batchgen.schemas import BatchInputLine, BatchOutputLine

from .engine import EngineResult, LLMEngine
from .serving import BatchDefaults, OpenAIServing, RequestRejected, decode_input_line


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
    engine: LLMEngine,
    input_path: Path,
    output_path: Path,
    errors_path: Path | None = None,
    defaults: BatchDefaults | None = None,
    progress: bool = True,
) -> RunBatchSummary:
    """Process every line; successes go to ``output_path``, failures to ``errors_path`` (or the output if unset).

    Lines are read lazily and at most a few steps' worth are in flight, so memory stays flat on huge files.
    """
    defaults = defaults or BatchDefaults()
    serving = OpenAIServing(engine.tokenizer, engine.model_name, engine.max_context_length)
    group = f"run-batch-{uuid.uuid4().hex[:8]}"
    in_flight_limit = 4 * engine.config.max_num_seqs
    summary = RunBatchSummary(total=_count_lines(input_path))
    encoder = msgspec.json.Encoder()
    pending: dict[str, _Pending] = {}
    owner: dict[str, str] = {}  # engine request id -> line request id
    start = time.monotonic()
    with (
        input_path.open("rb") as source,
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

        lines = _input_lines(source)
        exhausted = False
        while True:
            while not exhausted and len(owner) < in_flight_limit:
                raw = next(lines, None)
                if raw is None:
                    exhausted = True
                    break
                request_id = f"req_{uuid.uuid4().hex}"
                try:
                    line = decode_input_line(raw)
                    requests = serving.to_engine_requests(line, request_id=request_id, defaults=defaults, group=group)
                except RequestRejected as exc:
                    custom_id = _custom_id(raw)
                    rejected = serving.error_line(
                        custom_id, request_id=request_id, code=exc.code, message=exc.message, param=exc.param
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


def _input_lines(source: IO[bytes]) -> Iterator[bytes]:
    for raw in source:
        if raw.strip():
            yield raw


def _count_lines(path: Path) -> int:
    with path.open("rb") as source:
        return sum(1 for raw in source if raw.strip())


def _custom_id(raw: bytes) -> str:
    """Best effort: the custom_id of a line that failed to decode, so its error line can still be matched."""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return ""
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    return custom_id if isinstance(custom_id, str) else ""


class _nullcontext:
    """Use an already open file as a context manager without closing it."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file

    def __enter__(self) -> IO[bytes]:
        return self.file

    def __exit__(self, *exc: object) -> None:
        return None
