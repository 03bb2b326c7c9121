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

from batchgen.schemas import (
    ACTIVE_STATUSES,
    BatchErrors,
    BatchObject,
    BatchRequestCounts,
    BatchUsage,
    FileObject,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseFormat,
)

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
    line_count INTEGER NOT NULL DEFAULT 0,
    sequences INTEGER NOT NULL DEFAULT 0
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
    reasoning_tokens INTEGER NOT NULL DEFAULT 0,
    metadata TEXT,
    max_decoding_length INTEGER,
    max_context_length INTEGER,
    temperature REAL,
    top_p REAL,
    top_k INTEGER,
    response_format TEXT,
    output_expiry_s INTEGER
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
_MIGRATIONS = (
    # Files uploaded before work was counted in sequences: their line count is the closest figure.
    (
        "files",
        "sequences",
        "ALTER TABLE files ADD COLUMN sequences INTEGER NOT NULL DEFAULT 0; UPDATE files SET sequences = line_count",
    ),
    ("batches", "reasoning_tokens", "ALTER TABLE batches ADD COLUMN reasoning_tokens INTEGER NOT NULL DEFAULT 0"),
    ("batches", "response_format", "ALTER TABLE batches ADD COLUMN response_format TEXT"),
    ("batches", "output_expiry_s", "ALTER TABLE batches ADD COLUMN output_expiry_s INTEGER"),
)
_encode = msgspec.json.encode


class Database:
    """Thread-safe: each thread gets its own connection; SQLite's WAL lets readers run beside the one writer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        self._opened: list[sqlite3.Connection] | None = []
        """Every thread's connection: ``close`` closes them all, whichever thread calls it (``None`` once closed)."""
        self._opened_lock = threading.Lock()
        self._conn.executescript(_SCHEMA)
        for table, column, script in _MIGRATIONS:
            if column not in {row["name"] for row in self._conn.execute(f"PRAGMA table_info({table})")}:
                self._conn.executescript(f"BEGIN; {script}; COMMIT")

    @property
    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")  # an acknowledged upload or batch survives a power cut
            conn.execute("PRAGMA foreign_keys=ON")
            with self._opened_lock:
                if self._opened is None:  # closed meanwhile (a thread that outlived the server's stop)
                    conn.close()
                    raise sqlite3.ProgrammingError("the database is closed")
                self._opened.append(conn)
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

    def insert_file(self, file: FileObject, *, owner: str, line_count: int = 0, sequences: int = 0) -> None:
        with self._transaction() as conn:
            _insert_file(conn, file, owner, line_count, sequences)

    def get_file(self, file_id: str, *, owner: str | None) -> FileObject | None:
        """``owner=None`` looks across tenants (internal use only)."""
        row = self._one("files", file_id, owner)
        return None if row is None else _file(row)

    def file_work(self, file_id: str) -> tuple[int, int]:
        """An input file's requests and the sequences they ask for, as counted at upload."""
        row = self._conn.execute("SELECT line_count, sequences FROM files WHERE id = ?", (file_id,)).fetchone()
        return (0, 0) if row is None else (int(row[0]), int(row[1]))

    def list_files(
        self, *, owner: str, purpose: str | None, limit: int, order: Literal["asc", "desc"], after: str | None
    ) -> tuple[list[FileObject], bool]:
        where, params = ["owner = ?", "(expires_at IS NULL OR expires_at > ?)"], [owner, int(time.time())]
        if purpose is not None:
            where.append("purpose = ?")
            params.append(purpose)
        rows = self._page("files", owner, where, params, limit=limit, order=order, after=after)
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

    def insert_batch(self, batch: BatchObject, *, owner: str, output_expiry_s: int | None = None) -> None:
        """``output_expiry_s``: its output and error files expire that long after they are created."""
        columns = [*_BATCH_SCALARS, "total", "metadata", "response_format", "owner", "output_expiry_s"]
        values = [getattr(batch, column) for column in _BATCH_SCALARS]
        values += [batch.request_counts.total, _json_or_none(batch.metadata), _json_or_none(batch.response_format)]
        values += [owner, output_expiry_s]
        with self._transaction() as conn:
            conn.execute(f"INSERT INTO batches ({', '.join(columns)}) VALUES ({_marks(columns)})", values)

    def output_expiry(self, batch_id: str) -> int | None:
        row = self._conn.execute("SELECT output_expiry_s FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else row["output_expiry_s"]

    def get_batch(self, batch_id: str, *, owner: str | None) -> BatchObject | None:
        row = self._one("batches", batch_id, owner)
        return None if row is None else _batch(row)

    def list_batches(self, *, owner: str, limit: int, after: str | None) -> tuple[list[BatchObject], bool]:
        rows = self._page("batches", owner, ["owner = ?"], [owner], limit=limit, order="desc", after=after)
        return [_batch(row) for row in rows[:limit]], len(rows) > limit

    def unfinished_batches(self) -> list[tuple[BatchObject, str]]:
        """Every batch not in a final status, oldest first, across tenants, with its owner: the batch loop's work."""
        rows = self._conn.execute(
            f"SELECT * FROM batches WHERE status IN ({_marks(ACTIVE_STATUSES)}) ORDER BY seq", ACTIVE_STATUSES
        ).fetchall()
        return [(_batch(row), str(row["owner"])) for row in rows]

    def update_batch(self, batch_id: str, **fields: Any) -> None:
        if "errors" in fields:
            fields["errors"] = _json_or_none(fields["errors"])
        self._update("batches", batch_id, fields)

    def start_batch(self, batch_id: str, *, owner: str, files: list[FileObject], **fields: Any) -> None:
        """Insert a batch's (empty) results files and set ``fields`` in one transaction."""
        with self._transaction() as conn:
            for file in files:
                _insert_file(conn, file, owner, 0, 0)
            _update(conn, "batches", batch_id, fields)

    def finish_batch(
        self, batch_id: str, *, publish: dict[str, tuple[int, str]], drop: list[str], **fields: Any
    ) -> None:
        """In one transaction: set a batch's final ``fields``, mark the files of ``publish`` processed with their
        (size, checksum), and delete the rows of ``drop``."""
        if "errors" in fields:
            fields["errors"] = _json_or_none(fields["errors"])
        with self._transaction() as conn:
            _update(conn, "batches", batch_id, fields)
            for file_id, (size, checksum) in publish.items():
                _update(conn, "files", file_id, {"status": "processed", "bytes": size, "checksum": checksum})
            conn.executemany("DELETE FROM files WHERE id = ?", [(file_id,) for file_id in drop])

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
        self, table: str, owner: str, where: list[str], params: list[Any], *, limit: int, order: str, after: str | None
    ) -> list[sqlite3.Row]:
        """One page in ``seq`` order after the cursor ``after``; an unknown cursor, or another tenant's id, gives an
        empty page (the same answer, so a cursor cannot probe which ids exist)."""
        if after is not None:
            cursor = f"(SELECT seq FROM {table} WHERE id = ? AND owner = ?)"
            where = [*where, f"seq {'<' if order == 'desc' else '>'} COALESCE({cursor}, ?)"]
            params = [*params, after, owner, -1 if order == "desc" else 2**62]
        sql = f"SELECT * FROM {table} WHERE {' AND '.join(where)} ORDER BY seq {order.upper()} LIMIT ?"
        return self._conn.execute(sql, [*params, limit + 1]).fetchall()

    def _update(self, table: str, object_id: str, fields: dict[str, Any]) -> None:
        with self._transaction() as conn:
            _update(conn, table, object_id, fields)

    def close(self) -> None:
        """Close every thread's connection (a thread that uses the database after this gets an error)."""
        with self._opened_lock:
            opened, self._opened = self._opened or [], None
        for conn in opened:
            conn.close()


def _insert_file(conn: sqlite3.Connection, file: FileObject, owner: str, line_count: int, sequences: int) -> None:
    values = [getattr(file, column) for column in _FILE_COLUMNS]
    columns = [*_FILE_COLUMNS, "owner", "line_count", "sequences"]
    conn.execute(
        f"INSERT INTO files ({', '.join(columns)}) VALUES ({_marks(columns)})", [*values, owner, line_count, sequences]
    )


def _update(conn: sqlite3.Connection, table: str, object_id: str, fields: dict[str, Any]) -> None:
    assignments = ", ".join(f"{column} = ?" for column in fields)
    conn.execute(f"UPDATE {table} SET {assignments} WHERE id = ?", [*fields.values(), object_id])


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
        response_format=(
            None if row["response_format"] is None else msgspec.json.decode(row["response_format"], type=ResponseFormat)
        ),
        request_counts=BatchRequestCounts(total=row["total"], completed=row["completed"], failed=row["failed"]),
        usage=BatchUsage(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=row["cached_tokens"]),
            output_tokens=output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=row["reasoning_tokens"]),
            total_tokens=input_tokens + output_tokens,
        ),
    )
