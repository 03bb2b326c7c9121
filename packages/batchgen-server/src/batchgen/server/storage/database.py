"""Metadata of files, batches and idempotency keys in SQLite (WAL mode, one connection per thread).

Every query is scoped by ``owner`` (the tenant: ``security.auth.tenant_id`` of the API key, ``""`` without
authentication), so an object of another tenant simply does not exist. Rows map to the wire structs of
``batchgen.schemas`` directly.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import msgspec

from batchgen.schemas import BatchErrors, BatchObject, BatchRequestCounts, BatchUsage, FileObject, InputTokensDetails

ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    status TEXT NOT NULL,
    status_details TEXT,
    expires_at INTEGER,
    checksum TEXT,
    line_count INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS files_owner ON files (owner, purpose, seq);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    model TEXT,
    errors TEXT,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    output_file_id TEXT,
    error_file_id TEXT,
    created_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    expires_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    metadata TEXT,
    max_decoding_length INTEGER,
    max_context_length INTEGER,
    temperature REAL,
    top_p REAL,
    top_k INTEGER
);
CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner, seq);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    owner TEXT NOT NULL,
    route TEXT NOT NULL,
    key TEXT NOT NULL,
    object_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (owner, route, key)
);
"""

_FILE_COLUMNS = (
    "id",
    "bytes",
    "created_at",
    "filename",
    "purpose",
    "status",
    "status_details",
    "expires_at",
    "checksum",
)
_BATCH_SCALARS = (
    "id",
    "endpoint",
    "model",
    "input_file_id",
    "completion_window",
    "status",
    "output_file_id",
    "error_file_id",
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
    "max_decoding_length",
    "max_context_length",
    "temperature",
    "top_p",
    "top_k",
)
_encode = msgspec.json.encode


class Database:
    """Thread-safe: each thread gets its own connection; SQLite's WAL lets readers run beside the one writer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        self._conn.executescript(_SCHEMA)

    @property
    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")  # an acknowledged upload or batch survives a power cut
            conn.execute("PRAGMA foreign_keys=ON")
            self._local.conn = conn
        return conn

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    # -- files -------------------------------------------------------------------------------------------------

    def insert_file(self, file: FileObject, *, owner: str, line_count: int = 0) -> None:
        values = [getattr(file, column) for column in _FILE_COLUMNS]
        with self._transaction() as conn:
            conn.execute(
                f"INSERT INTO files ({', '.join(_FILE_COLUMNS)}, owner, line_count) "
                f"VALUES ({', '.join('?' * (len(_FILE_COLUMNS) + 2))})",
                [*values, owner, line_count],
            )

    def get_file(self, file_id: str, *, owner: str | None) -> FileObject | None:
        """``owner=None`` looks across tenants (internal use only)."""
        row = self._one("files", file_id, owner)
        return None if row is None else _file(row)

    def file_line_count(self, file_id: str) -> int:
        row = self._conn.execute("SELECT line_count FROM files WHERE id = ?", (file_id,)).fetchone()
        return 0 if row is None else int(row[0])

    def list_files(
        self, *, owner: str, purpose: str | None, limit: int, order: Literal["asc", "desc"], after: str | None
    ) -> tuple[list[FileObject], bool]:
        where, params = ["owner = ?", "(expires_at IS NULL OR expires_at > ?)"], [owner, int(time.time())]
        if purpose is not None:
            where.append("purpose = ?")
            params.append(purpose)
        rows = self._page("files", where, params, limit=limit, order=order, after=after)
        return [_file(row) for row in rows[:limit]], len(rows) > limit

    def update_file(self, file_id: str, **fields: Any) -> None:
        self._update("files", file_id, fields)

    def delete_file(self, file_id: str) -> None:
        with self._transaction() as conn:
            conn.execute("DELETE FROM files WHERE id = ?", (file_id,))

    def expired_files(self, now: int) -> list[str]:
        """Files past their ``expires_at`` that no unfinished batch reads or writes (those go once it finishes)."""
        rows = self._conn.execute(
            f"SELECT id FROM files WHERE expires_at IS NOT NULL AND expires_at <= ? AND NOT EXISTS ("
            f"SELECT 1 FROM batches WHERE status IN ({_marks(ACTIVE_STATUSES)}) "
            "AND files.id IN (input_file_id, output_file_id, error_file_id))",
            (now, *ACTIVE_STATUSES),
        ).fetchall()
        return [row[0] for row in rows]

    def file_in_use(self, file_id: str) -> bool:
        """Whether an unfinished batch reads or writes this file."""
        row = self._conn.execute(
            f"SELECT 1 FROM batches WHERE status IN ({_marks(ACTIVE_STATUSES)}) "
            "AND ? IN (input_file_id, output_file_id, error_file_id) LIMIT 1",
            (*ACTIVE_STATUSES, file_id),
        ).fetchone()
        return row is not None

    # -- batches -----------------------------------------------------------------------------------------------

    def insert_batch(self, batch: BatchObject, *, owner: str) -> None:
        columns = [*_BATCH_SCALARS, "total", "metadata", "owner"]
        values = [getattr(batch, column) for column in _BATCH_SCALARS]
        values += [batch.request_counts.total, _json_or_none(batch.metadata), owner]
        with self._transaction() as conn:
            conn.execute(f"INSERT INTO batches ({', '.join(columns)}) VALUES ({_marks(columns)})", values)

    def get_batch(self, batch_id: str, *, owner: str | None) -> BatchObject | None:
        row = self._one("batches", batch_id, owner)
        return None if row is None else _batch(row)

    def owner_of_batch(self, batch_id: str) -> str:
        row = self._conn.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return "" if row is None else str(row[0])

    def list_batches(self, *, owner: str, limit: int, after: str | None) -> tuple[list[BatchObject], bool]:
        rows = self._page("batches", ["owner = ?"], [owner], limit=limit, order="desc", after=after)
        return [_batch(row) for row in rows[:limit]], len(rows) > limit

    def batches_with_status(self, statuses: Iterable[str]) -> list[BatchObject]:
        """Oldest first, across tenants: what the runner must pick up (again) at startup."""
        statuses = tuple(statuses)
        rows = self._conn.execute(
            f"SELECT * FROM batches WHERE status IN ({_marks(statuses)}) ORDER BY seq", statuses
        ).fetchall()
        return [_batch(row) for row in rows]

    def update_batch(self, batch_id: str, *, only_if_status: Iterable[str] | None = None, **fields: Any) -> bool:
        """Set ``fields``; with ``only_if_status`` only while the batch is in one of them (an atomic transition).
        Returns whether the row changed."""
        if "errors" in fields:
            fields["errors"] = _json_or_none(fields["errors"])
        return self._update("batches", batch_id, fields, only_if_status=only_if_status)

    def finish_batch(self, batch_id: str, *, drop_files: list[str], **fields: Any) -> None:
        """Set a batch's final ``fields`` and delete the rows of ``drop_files`` in one transaction."""
        assignments = ", ".join(f"{column} = ?" for column in fields)
        with self._transaction() as conn:
            conn.execute(f"UPDATE batches SET {assignments} WHERE id = ?", [*fields.values(), batch_id])
            conn.executemany("DELETE FROM files WHERE id = ?", [(file_id,) for file_id in drop_files])

    def queued_requests(self) -> int:
        """Requests accepted but not yet finished, over every unfinished batch of every tenant."""
        row = self._conn.execute(
            "SELECT COALESCE(SUM(total - completed - failed), 0) FROM batches "
            f"WHERE status IN ({_marks(ACTIVE_STATUSES)})",
            ACTIVE_STATUSES,
        ).fetchone()
        return int(row[0])

    def batch_status_counts(self) -> dict[str, int]:
        rows = self._conn.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall()
        return {row[0]: int(row[1]) for row in rows}

    def request_totals(self) -> dict[str, int]:
        """Sums over all batches: completed and failed requests, prompt and completion tokens."""
        row = self._conn.execute(
            "SELECT COALESCE(SUM(completed), 0), COALESCE(SUM(failed), 0), "
            "COALESCE(SUM(input_tokens), 0), COALESCE(SUM(output_tokens), 0) FROM batches"
        ).fetchone()
        return dict(zip(("completed", "failed", "input_tokens", "output_tokens"), map(int, row), strict=True))

    # -- idempotency keys --------------------------------------------------------------------------------------

    def idempotent_object(self, *, owner: str, route: str, key: str) -> str | None:
        row = self._conn.execute(
            "SELECT object_id FROM idempotency_keys WHERE owner = ? AND route = ? AND key = ?", (owner, route, key)
        ).fetchone()
        return None if row is None else str(row[0])

    def bind_idempotency_key(self, *, owner: str, route: str, key: str, object_id: str, now: int) -> None:
        with self._transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO idempotency_keys (owner, route, key, object_id, created_at) "
                "VALUES (?, ?, ?, ?, ?)",
                (owner, route, key, object_id, now),
            )

    # -- helpers -----------------------------------------------------------------------------------------------

    def _one(self, table: str, object_id: str, owner: str | None) -> sqlite3.Row | None:
        if owner is None:
            return self._conn.execute(f"SELECT * FROM {table} WHERE id = ?", (object_id,)).fetchone()  # type: ignore[no-any-return]
        return self._conn.execute(  # type: ignore[no-any-return]
            f"SELECT * FROM {table} WHERE id = ? AND owner = ?", (object_id, owner)
        ).fetchone()

    def _page(
        self, table: str, where: list[str], params: list[Any], *, limit: int, order: str, after: str | None
    ) -> list[sqlite3.Row]:
        """One page in ``seq`` order after the cursor ``after`` (an unknown cursor gives an empty page)."""
        if after is not None:
            where = [
                *where,
                f"seq {'<' if order == 'desc' else '>'} COALESCE((SELECT seq FROM {table} WHERE id = ?), ?)",
            ]
            params = [*params, after, -1 if order == "desc" else 2**62]
        sql = f"SELECT * FROM {table} WHERE {' AND '.join(where)} ORDER BY seq {order.upper()} LIMIT ?"
        return self._conn.execute(sql, [*params, limit + 1]).fetchall()

    def _update(
        self, table: str, object_id: str, fields: dict[str, Any], *, only_if_status: Iterable[str] | None = None
    ) -> bool:
        assignments = ", ".join(f"{column} = ?" for column in fields)
        sql, params = f"UPDATE {table} SET {assignments} WHERE id = ?", [*fields.values(), object_id]
        if only_if_status is not None:
            statuses = tuple(only_if_status)
            sql += f" AND status IN ({_marks(statuses)})"
            params += statuses
        with self._transaction() as conn:
            return conn.execute(sql, params).rowcount > 0

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


def _marks(values: Iterable[object]) -> str:
    return ", ".join("?" for _ in values)


def _json_or_none(value: object) -> str | None:
    return None if value is None else _encode(value).decode()


def _file(row: sqlite3.Row) -> FileObject:
    return FileObject(**{column: row[column] for column in _FILE_COLUMNS})


def _batch(row: sqlite3.Row) -> BatchObject:
    input_tokens, output_tokens = row["input_tokens"], row["output_tokens"]
    return BatchObject(
        **{column: row[column] for column in _BATCH_SCALARS},
        errors=None if row["errors"] is None else msgspec.json.decode(row["errors"], type=BatchErrors),
        metadata=None if row["metadata"] is None else msgspec.json.decode(row["metadata"], type=dict[str, str]),
        request_counts=BatchRequestCounts(total=row["total"], completed=row["completed"], failed=row["failed"]),
        usage=BatchUsage(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=row["cached_tokens"]),
            output_tokens=output_tokens,
            total_tokens=input_tokens + output_tokens,
        ),
    )
