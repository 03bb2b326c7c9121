"""A tqdm bar of a batch's finished requests (completed + failed out of total) with the request rate."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm

from batchgen.schemas import BatchObject


def progress_wanted(progress: bool | None) -> bool:
    """``None`` means: show a bar when stderr is an interactive terminal or we run in a Jupyter kernel."""
    if progress is not None:
        return progress
    return sys.stderr.isatty() or "ipykernel" in sys.modules


class BatchProgress:
    """Advances by the requests that finished since the last poll, so tqdm's rate is requests per second."""

    def __init__(self, batch_id: str) -> None:
        self._bar: Any = tqdm(desc=batch_id, unit="req", dynamic_ncols=True)
        self._done = 0

    def update(self, batch: BatchObject) -> None:
        counts = batch.request_counts
        if counts.total and self._bar.total != counts.total:
            self._bar.total = counts.total
        self._bar.set_postfix(status=batch.status, failed=counts.failed, refresh=False)
        done = counts.completed + counts.failed
        self._bar.update(done - self._done)
        self._done = done

    def close(self) -> None:
        self._bar.close()
