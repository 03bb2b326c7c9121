"""What a batch's results files hold: the custom_ids answered and the counts and usage they add up to.

The files are the truth; the counters in the database are a cache of them, so after a crash they are recomputed
here and a resumed batch skips every request that already has a line.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from batchgen.schemas import BatchOutputLine, CompletionUsage, EmbeddingUsage, ResponseUsage, parse_output_line


def succeeded(line: BatchOutputLine) -> bool:
    """Whether the line belongs in the output file (a 200 answer) rather than the error file."""
    return line.response is not None and line.response.status_code == 200 and line.error is None


@dataclass(slots=True)
class Tally:
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    done: set[str] = field(default_factory=set)
    """custom_ids that have a line in the output or the error file."""

    def add(self, line: BatchOutputLine) -> None:
        self.done.add(line.custom_id)
        if not succeeded(line):
            self.failed += 1
            return
        self.completed += 1
        assert line.response is not None
        usage = getattr(line.response.body, "usage", None)
        if isinstance(usage, CompletionUsage):
            self.input_tokens += usage.prompt_tokens
            self.cached_tokens += usage.prompt_tokens_details.cached_tokens
            self.output_tokens += usage.completion_tokens
            self.reasoning_tokens += usage.completion_tokens_details.reasoning_tokens
        elif isinstance(usage, ResponseUsage):
            self.input_tokens += usage.input_tokens
            self.cached_tokens += usage.input_tokens_details.cached_tokens
            self.output_tokens += usage.output_tokens
            self.reasoning_tokens += usage.output_tokens_details.reasoning_tokens
        elif isinstance(usage, EmbeddingUsage):
            self.input_tokens += usage.prompt_tokens

    def counters(self) -> dict[str, int]:
        """The batch columns these totals are the truth of."""
        return {
            "completed": self.completed,
            "failed": self.failed,
            "input_tokens": self.input_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "reasoning_tokens": self.reasoning_tokens,
        }


def recover(path: Path, tally: Tally) -> Iterator[None]:
    """Count the whole lines of a results file into ``tally``, then cut off a line torn by a crash mid-write.

    A generator that yields after each line, so a caller can read a big file a slice at a time.
    """
    if not path.exists():
        return
    whole = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            whole += len(raw)
            # A line we cannot read is not ours to judge, and does not count as done.
            with contextlib.suppress(msgspec.DecodeError, ValueError):
                tally.add(parse_output_line(raw))
            yield
    if whole != path.stat().st_size:
        os.truncate(path, whole)
