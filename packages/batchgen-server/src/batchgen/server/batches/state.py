"""What the batch loop holds of each batch it runs; only the loop's thread reads or changes it."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from batchgen.schemas import BatchError, BatchInputLine, BatchObject, BatchOutputLine

from ..engine.request import EngineRequest, EngineResult
from ..serving import BatchDefaults, PreparedRequest
from ..storage.blobs import ResultsFile
from .results import Tally
from .stores import Results

RETRY_FIRST_S, RETRY_MAX_S = 0.25, 5.0
"""Backoff of a batch paused by a storage fault: the first wait, doubling up to the last."""


@dataclass(slots=True, eq=False)
class Entry:
    """A request line holding its place in the engine's window: being tokenized (``prepared`` is ``None``), then
    inside the engine until each of its engine requests has its result."""

    batch: Batch
    line: BatchInputLine
    request_id: str
    work: int
    """Its sequences (prompts x n), as the batch counts them."""
    inside: int = 0
    """Its sequences in the window now: all of them until its results come back, one request at a time."""
    prepared: PreparedRequest | None = None
    results: list[EngineResult | None] = field(default_factory=list)

    @property
    def requests(self) -> list[EngineRequest]:
        """Its engine requests, once tokenized."""
        return [] if self.prepared is None else self.prepared.requests


@dataclass(slots=True)
class Answer:
    """An output or error line on its way to disk; ``end`` is its file's size once appended."""

    line: BatchOutputLine
    data: bytes
    file: ResultsFile
    end: int = 0


@dataclass(slots=True, eq=False)
class Batch:
    record: BatchObject
    owner: str
    status: str
    work: int
    """Sequences not answered yet: the upload's count until prepared, then exact."""
    defaults: BatchDefaults
    started: bool
    """It has (or had) results files: what it wrote must be read back before it can finish."""
    preparing: Iterator[None] | None = None
    total: int = 0
    errors: list[BatchError] = field(default_factory=list)
    """Of the input file, found while preparing."""
    lines: Iterator[BatchInputLine] | None = None
    """The unanswered lines not yet taken; ``None`` once exhausted (or stopped)."""
    taken: set[str] = field(default_factory=set)
    """custom_ids answered before a restart or taken from ``lines`` since: a new pass over the input skips them."""
    held: deque[BatchInputLine] = field(default_factory=deque)
    """Lines taken that wait, first in input order: for room in the engine, for the struck line on probation to
    leave it, or to be tokenized again after a storage fault."""
    in_window: dict[str, Entry] = field(default_factory=dict)
    """By request id, in the order taken."""
    running: int = 0
    """Sequences in the window: its share, which the turns even out."""
    results: Results | None = None
    tally: Tally = field(default_factory=Tally)
    """What is durably written."""
    unwritten: deque[Answer] = field(default_factory=deque)
    unsynced: list[Answer] = field(default_factory=list)
    published: bool = True
    """The store's counts match ``tally``."""
    synced_at: float = 0.0
    stopping: str | None = None
    """``cancelled`` or ``expired``: no new work; finish once what is answered is written."""
    failure: str | None = None
    fault: str | None = None
    retry_at: float = 0.0
    backoff: float = RETRY_FIRST_S

    @property
    def id(self) -> str:
        return self.record.id

    def files(self) -> list[ResultsFile]:
        return [] if self.results is None else list(dict.fromkeys(self.results))
