"""What a batch's results files already hold: the custom_ids answered and the counts and usage they add up to.

The files are the truth; the counters in the database are a cache of them, so after a crash they are recomputed
here and a resumed batch skips every request that already has a line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from batchgen.schemas import BatchOutputLine, CompletionUsage, EmbeddingUsage, parse_output_line


@dataclass(slots=True)
class Tally:
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    done: set[str] = field(default_factory=set)
    """custom_ids that have a line in the output or the error file."""

    def add(self, line: BatchOutputLine) -> None:
        self.done.add(line.custom_id)
        response = line.response
        if response is None or response.status_code != 200 or line.error is not None:
            self.failed += 1
            return
        self.completed += 1
        usage = getattr(response.body, "usage", None)
        if isinstance(usage, CompletionUsage):
            self.input_tokens += usage.prompt_tokens
            self.cached_tokens += usage.prompt_tokens_details.cached_tokens
            self.output_tokens += usage.completion_tokens
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
        }


def recover_tally(paths: list[Path]) -> Tally:
    """Tally existing results files, first cutting off a line torn by a crash mid-write."""
    tally = Tally()
    for path in paths:
        if not path.exists():
            continue
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            os.truncate(path, end)
        for raw in data[:end].splitlines():
            if raw.strip():
                try:
                    tally.add(parse_output_line(raw))
                except (msgspec.DecodeError, ValueError):
                    continue  # not ours to judge; a line we cannot read does not count as done
    return tally
