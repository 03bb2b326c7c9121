"""Every sequence's block table again as a row of one array, kept in step with its list by the block manager.

A step cuts its decodes' rows from here with one index (the decode kernel's input, ``attention/decode.py``), not
with a Python pass over every block: a decode step at batch 256 and 512-token contexts names 8,500 blocks, 0.5 ms of
the host's time on CPU that way; its prefill chunks' cache slots come from here too. This is vLLM's persistent block
table: a row is written when its sequence gains a block (once every ``block_size`` tokens), not every step.

A row holds its sequence's blocks from column 0; what lies past them is stale (rows are reused): valid block ids, so
a kernel may be handed them, but readers must not attend to them.
"""

from __future__ import annotations

import numpy as np

from ..sequence import Sequence


class BlockTables:
    def __init__(self, rows: int = 64, columns: int = 64) -> None:
        self.array = np.zeros((rows, columns), dtype=np.int64)
        """``[rows, columns]``: sequence ``s``'s ``i``-th block is ``array[s.table_row, i]``. Replaced by a larger
        copy when it grows. A step reads it only while its forward is built, and keeps copies of what it read."""
        self._free_rows = list(range(rows - 1, -1, -1))

    @property
    def rows_in_use(self) -> int:
        return self.array.shape[0] - len(self._free_rows)

    def append(self, seq: Sequence, block: int) -> None:
        """Add ``block`` to the end of ``seq``'s table, list and row."""
        if seq.table_row < 0:
            seq.table_row = self._take_row()
        column = len(seq.block_table)
        if column >= self.array.shape[1]:
            self._grow(columns=2 * column)
        self.array[seq.table_row, column] = block
        seq.block_table.append(block)

    def copy(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` (holding no blocks) the same table as ``parent``."""
        assert child.table_row < 0, "the child holds a row already"
        child.table_row = self._take_row()
        child.block_table = list(parent.block_table)
        self.array[child.table_row, : len(child.block_table)] = self.array[parent.table_row, : len(parent.block_table)]

    def replace_last(self, seq: Sequence, block: int) -> None:
        seq.block_table[-1] = block
        self.array[seq.table_row, len(seq.block_table) - 1] = block

    def release(self, seq: Sequence) -> None:
        """Empty ``seq``'s table; its row goes back for another sequence."""
        if seq.table_row >= 0:
            self._free_rows.append(seq.table_row)
            seq.table_row = -1
        seq.block_table = []

    def _take_row(self) -> int:
        if not self._free_rows:
            rows = self.array.shape[0]
            self._grow(rows=2 * rows)
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _grow(self, rows: int = 0, columns: int = 0) -> None:
        old = self.array
        self.array = np.zeros((max(rows, old.shape[0]), max(columns, old.shape[1])), dtype=np.int64)
        self.array[: old.shape[0], : old.shape[1]] = old
