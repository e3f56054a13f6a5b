"""Files and batches in one SQLite database under the data dir: a real file that survives restarts.

The schema is versioned with SQLite's `user_version`; opening a database runs the migrations it has not seen, in
order, each in its own transaction. A database from a newer server is refused rather than guessed at.

One connection behind a lock: the API's handlers and the batch runner's threads all go through it, and each call
is a short statement, so contention is negligible next to the HTTP round trip."""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.server.schemas import (
    FINAL_STATUSES,
    BatchError,
    BatchErrors,
    BatchObject,
    BatchUsage,
    FileObject,
    InputTokensDetails,
    OutputTokensDetails,
    RequestCounts,
)

# Each entry moves the schema one version up; never edit one that has shipped, add the next.
MIGRATIONS: list[str] = [
    # 1: files (uploads and batch outputs) and batches.
    """
    CREATE TABLE files (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        filename TEXT NOT NULL,
        purpose TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        lines INTEGER,               -- uploads: request lines counted while streaming in
        batch_id TEXT,               -- batch_output: the batch it comes from
        kind TEXT,                   -- batch_output: results or errors
        deleted INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE batches (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        endpoint TEXT NOT NULL,
        input_file_id TEXT NOT NULL,
        completion_window TEXT NOT NULL,
        status TEXT NOT NULL,
        metadata TEXT,
        errors TEXT,
        output_file_id TEXT,
        error_file_id TEXT,
        total INTEGER NOT NULL DEFAULT 0,
        completed INTEGER NOT NULL DEFAULT 0,
        failed INTEGER NOT NULL DEFAULT 0,
        created_at INTEGER NOT NULL,
        in_progress_at INTEGER, expires_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
        failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER
    );
    """,
    # 2: listing is per owner, newest first; `seq` orders objects created in the same second.
    """
    ALTER TABLE files ADD COLUMN seq INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE batches ADD COLUMN seq INTEGER NOT NULL DEFAULT 0;
    UPDATE files SET seq = rowid;
    UPDATE batches SET seq = rowid;
    CREATE INDEX files_by_owner ON files (owner, seq);
    CREATE INDEX batches_by_owner ON batches (owner, seq);
    """,
    # 3: retention (when a file expires, whether its bytes are still on disk, how long a batch's output files live,
    # whether its folder is gone), file statuses, and a batch's usage and model. Rows of an older server keep
    # everything: no expiry, bytes on disk (the sweeper frees those of files it had deleted).
    """
    ALTER TABLE files ADD COLUMN expires_at INTEGER;                    -- null: kept until deleted
    ALTER TABLE files ADD COLUMN status TEXT NOT NULL DEFAULT 'processed';
    ALTER TABLE files ADD COLUMN status_details TEXT;
    ALTER TABLE files ADD COLUMN stored INTEGER NOT NULL DEFAULT 1;     -- its bytes are on disk
    ALTER TABLE batches ADD COLUMN output_expires_seconds INTEGER;      -- its output files' lifetime; null: kept
    ALTER TABLE batches ADD COLUMN purged INTEGER NOT NULL DEFAULT 0;   -- its folder is removed
    ALTER TABLE batches ADD COLUMN model TEXT;
    ALTER TABLE batches ADD COLUMN input_tokens INTEGER;                -- usage: null until the batch ends
    ALTER TABLE batches ADD COLUMN cached_tokens INTEGER;
    ALTER TABLE batches ADD COLUMN output_tokens INTEGER;
    ALTER TABLE batches ADD COLUMN reasoning_tokens INTEGER;
    CREATE INDEX files_by_expiry ON files (expires_at) WHERE deleted = 0 AND expires_at IS NOT NULL;
    CREATE INDEX files_held ON files (owner, stored);
    CREATE INDEX files_by_batch ON files (batch_id);
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)

_TIMESTAMPS = (
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


_FINAL = "('failed', 'completed', 'expired', 'cancelled')"
# A file visible through the API: not deleted, not past its expires_at (the sweeper marks expired files deleted
# later; until then they are already gone for every request).
_LIVE = "deleted = 0 AND (expires_at IS NULL OR expires_at > ?)"


class StoreError(RuntimeError):
    pass


class FileGone(StoreError):
    """The input file was deleted or expired as the batch was created."""


def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    """An unguessable id: 96 random bits, as OpenAI's ids are opaque."""
    return f"{prefix}{secrets.token_hex(12)}"


def migrate(conn: sqlite3.Connection, path: Path | str) -> int:
    """Bring the database to SCHEMA_VERSION; returns the version it had."""
    found = conn.execute("PRAGMA user_version").fetchone()[0]
    if found > SCHEMA_VERSION:
        raise StoreError(
            f"{path} has schema version {found}, newer than this server's {SCHEMA_VERSION}: run a newer nightshift"
        )
    for version in range(found, SCHEMA_VERSION):
        # executescript commits first; the explicit BEGIN/COMMIT makes each migration all-or-nothing.
        conn.executescript(f"BEGIN; {MIGRATIONS[version]} PRAGMA user_version = {version + 1}; COMMIT;")
    return found


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        # Pinned, not left to how SQLite was built: a commit (an accepted upload's row, a batch's state) reaches the
        # disk before the client is answered, power cut or not.
        self._conn.execute("PRAGMA synchronous=FULL")
        self._lock = threading.Lock()
        with self._lock:
            # 0: the database was created now (whatever else the data dir holds, no row of it names anything yet).
            self.found_version = migrate(self._conn, path)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _one(self, sql: str, args: tuple) -> sqlite3.Row | None:
        with self._lock:
            return self._conn.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    # -- files ------------------------------------------------------------------------------------------------
    def add_file(
        self,
        file_id: str,
        owner: str,
        filename: str,
        purpose: str,
        size: int,
        lines: int | None = None,
        batch_id: str | None = None,
        kind: str | None = None,
        expires_seconds: int | None = None,
        status: str = "processed",
        status_details: str | None = None,
    ) -> FileObject:
        """A new file. It expires `expires_seconds` after it is made; a batch's output file without them, after
        its batch's output_expires_seconds (null: kept until deleted)."""
        now = int(time.time())
        with self._tx() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM files").fetchone()[0]
            if expires_seconds is None and batch_id is not None:
                found = db.execute(
                    "SELECT output_expires_seconds FROM batches WHERE id = ?", (batch_id,)
                ).fetchone()
                expires_seconds = found[0] if found else None
            db.execute(
                "INSERT INTO files (id, owner, filename, purpose, bytes, created_at, lines, batch_id, kind, seq,"
                " expires_at, status, status_details) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    file_id,
                    owner,
                    filename,
                    purpose,
                    size,
                    now,
                    lines,
                    batch_id,
                    kind,
                    seq,
                    now + expires_seconds if expires_seconds is not None else None,
                    status,
                    status_details,
                ),
            )
        found = self.file_row(file_id, owner)
        assert found is not None
        return file_object(found)

    def file_row(self, file_id: str, owner: str) -> sqlite3.Row | None:
        """A file of this owner, or None: another owner's file is as absent as one that never existed."""
        return self._one(
            f"SELECT * FROM files WHERE id = ? AND owner = ? AND {_LIVE}", (file_id, owner, _now())
        )

    def list_files(
        self, owner: str, after: str | None, limit: int, purpose: str | None, ascending: bool
    ) -> tuple[list[FileObject], bool]:
        return self._page("files", owner, after, limit, ascending, purpose, file_object)

    def delete_file(self, file_id: str, owner: str) -> bool:
        with self._tx() as db:
            cur = db.execute(
                "UPDATE files SET deleted = 1 WHERE id = ? AND owner = ? AND deleted = 0", (file_id, owner)
            )
            return cur.rowcount == 1

    def owner_files_usage(self, owner: str) -> tuple[int, int]:
        """(files, bytes) of an owner's files not deleted (what server/quotas.py counts against its limits)."""
        row = self._one(
            "SELECT COUNT(*) AS n, COALESCE(SUM(bytes), 0) AS size FROM files WHERE owner = ? AND deleted = 0",
            (owner,),
        )
        assert row is not None
        return row["n"], row["size"]

    def unpurged_batches_of(self, owner: str) -> list[tuple[str, int, bool]]:
        """(batch id, bytes of its output files on disk, whether it has ended) for each of the owner's batches
        whose folder is still there and is not just a completed batch's registered output (server/disk_use.py)."""
        rows = self._all(
            "SELECT b.id AS id, COALESCE((SELECT SUM(f.bytes) FROM files f WHERE f.batch_id = b.id"
            f" AND f.stored = 1), 0) AS registered, b.status IN {_FINAL} AS ended FROM batches b"
            " WHERE b.owner = ? AND b.purged = 0 AND b.status != 'completed'",
            (owner,),
        )
        return [(r["id"], r["registered"], bool(r["ended"])) for r in rows]

    def file_in_use(self, file_id: str) -> bool:
        """Whether an unfinished batch reads this upload (its content must outlive a delete until then)."""
        row = self._one(
            "SELECT 1 FROM batches WHERE input_file_id = ? AND status NOT IN "
            "('failed', 'completed', 'expired', 'cancelled') LIMIT 1",
            (file_id,),
        )
        return row is not None

    # -- retention (server/retention.py) ----------------------------------------------------------------------------
    def expire_files(self, now: int) -> list[str]:
        """Mark every file past its expires_at deleted; returns their ids."""
        with self._tx() as db:
            rows = db.execute(
                "UPDATE files SET deleted = 1 WHERE deleted = 0 AND expires_at IS NOT NULL AND expires_at <= ?"
                " RETURNING id",
                (now,),
            ).fetchall()
        return [r["id"] for r in rows]

    def files_to_free(self) -> list[sqlite3.Row]:
        """Deleted files whose bytes are still on disk and may go: a batch's output files, and uploads no
        unfinished batch reads (a deleted upload never gains a reader: add_batch refuses it)."""
        return self._all(
            "SELECT * FROM files f WHERE deleted = 1 AND stored = 1 AND (purpose != 'batch' OR NOT EXISTS ("
            f"SELECT 1 FROM batches b WHERE b.input_file_id = f.id AND b.status NOT IN {_FINAL}))",
            (),
        )

    def file_to_free(self, file_id: str) -> sqlite3.Row | None:
        """One file of `files_to_free`, or None (not deleted, freed already, or an upload still read)."""
        return self._one(
            "SELECT * FROM files f WHERE id = ? AND deleted = 1 AND stored = 1 AND (purpose != 'batch' OR NOT EXISTS"
            f" (SELECT 1 FROM batches b WHERE b.input_file_id = f.id AND b.status NOT IN {_FINAL}))",
            (file_id,),
        )

    def mark_freed(self, file_id: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE files SET stored = 0 WHERE id = ?", (file_id,))

    def batches_to_purge(self, now: int, batch_id: str | None = None) -> list[str]:
        """Finished batches whose folder may go: every output file of theirs deleted and freed — or, for a batch
        that made none, its output lifetime passed since it ended (its job log is kept that long)."""
        rows = self._all(
            f"SELECT id FROM batches b WHERE purged = 0 AND status IN {_FINAL}"
            + (" AND id = ?" if batch_id else "")
            + " AND NOT EXISTS (SELECT 1 FROM files f WHERE f.batch_id = b.id AND (f.deleted = 0 OR f.stored = 1))"
            " AND (EXISTS (SELECT 1 FROM files f WHERE f.batch_id = b.id) OR (output_expires_seconds IS NOT NULL"
            " AND COALESCE(completed_at, failed_at, expired_at, cancelled_at, created_at) + output_expires_seconds"
            " <= ?))",
            (*((batch_id,) if batch_id else ()), now),
        )
        return [r["id"] for r in rows]

    def mark_purged(self, batch_id: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE batches SET purged = 1 WHERE id = ?", (batch_id,))

    def stored_file_ids(self) -> list[str]:
        """Uploads whose bytes are on disk by the rows (everything else under files/ is a leftover)."""
        return [r["id"] for r in self._all("SELECT id FROM files WHERE purpose = 'batch' AND stored = 1", ())]

    def unpurged_batch_ids(self) -> list[str]:
        """Batches whose folder the rows keep (everything else under batches/ is a leftover)."""
        return [r["id"] for r in self._all("SELECT id FROM batches WHERE purged = 0", ())]

    def stored_by_purpose(self, owner: str) -> dict[str, tuple[int, int]]:
        """The owner's files whose bytes are on disk, per purpose: (files, bytes). Deleted files a batch still
        reads count: their bytes are held until it ends."""
        rows = self._all(
            "SELECT purpose, COUNT(*) AS n, COALESCE(SUM(bytes), 0) AS size FROM files WHERE owner = ? AND stored = 1"
            " GROUP BY purpose",
            (owner,),
        )
        return {r["purpose"]: (r["n"], r["size"]) for r in rows}

    # -- batches ----------------------------------------------------------------------------------------------
    def add_batch(
        self,
        batch_id: str,
        owner: str,
        endpoint: str,
        input_file_id: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        total: int,
        expires_at: int,
        output_expires_seconds: int | None = None,
    ) -> BatchObject:
        """A new batch, `validating`. Raises FileGone when its input was deleted or expired since the caller looked
        it up: checked in the same transaction, so the sweeper never frees an input a batch is about to read."""
        with self._tx() as db:
            gone = db.execute(
                "SELECT 1 FROM files WHERE id = ? AND (deleted = 1 OR expires_at <= ?)",
                (input_file_id, _now()),
            ).fetchone()
            if gone is not None:
                raise FileGone(input_file_id)
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            db.execute(
                "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, metadata,"
                " total, created_at, expires_at, seq, output_expires_seconds)"
                " VALUES (?, ?, ?, ?, ?, 'validating', ?, ?, ?, ?, ?, ?)",
                (
                    batch_id,
                    owner,
                    endpoint,
                    input_file_id,
                    completion_window,
                    json.dumps(metadata) if metadata is not None else None,
                    total,
                    int(time.time()),
                    expires_at,
                    seq,
                    output_expires_seconds,
                ),
            )
        found = self.batch(batch_id, owner)
        assert found is not None
        return found

    def batch(self, batch_id: str, owner: str | None = None) -> BatchObject | None:
        """A batch of this owner (any owner's when None: the runner's own view)."""
        if owner is None:
            row = self._one("SELECT * FROM batches WHERE id = ?", (batch_id,))
        else:
            row = self._one("SELECT * FROM batches WHERE id = ? AND owner = ?", (batch_id, owner))
        return batch_object(row) if row else None

    def list_batches(self, owner: str, after: str | None, limit: int) -> tuple[list[BatchObject], bool]:
        return self._page("batches", owner, after, limit, False, None, batch_object)

    def unfinished_batches(self) -> list[tuple[BatchObject, str]]:
        """Every batch not in a final status with its owner, oldest first (what a restarted server picks up)."""
        rows = self._all(
            "SELECT * FROM batches WHERE status NOT IN ('failed', 'completed', 'expired', 'cancelled') ORDER BY seq",
            (),
        )
        return [(batch_object(r), r["owner"]) for r in rows]

    def batch_status_counts(self, owner: str) -> dict[str, int]:
        rows = self._all(
            "SELECT status, COUNT(*) AS n FROM batches WHERE owner = ? GROUP BY status", (owner,)
        )
        return {r["status"]: r["n"] for r in rows}

    def unfinished_batches_of(self, owner: str) -> list[BatchObject]:
        rows = self._all(
            "SELECT * FROM batches WHERE owner = ? AND status NOT IN ('failed', 'completed', 'expired', 'cancelled')"
            " ORDER BY seq",
            (owner,),
        )
        return [batch_object(r) for r in rows]

    def owner_of(self, batch_id: str) -> str:
        row = self._one("SELECT owner FROM batches WHERE id = ?", (batch_id,))
        assert row is not None
        return row["owner"]

    def update_batch(self, batch_id: str, *, only_if: tuple[str, ...] = (), **fields: Any) -> bool:
        """Set fields of a batch; with `only_if`, only while its status is one of those (a status change that
        lost a race — e.g. a job finishing as it is cancelled — changes nothing). Returns whether it applied."""
        if "errors" in fields and fields["errors"] is not None:
            fields["errors"] = json.dumps([e.model_dump() for e in fields["errors"]])
        if "usage" in fields:  # a BatchUsage, kept as one column per count
            fields.update(usage_columns(fields.pop("usage")))
        sets = ", ".join(f"{k} = ?" for k in fields)
        sql = f"UPDATE batches SET {sets} WHERE id = ?"
        args: list[Any] = [*fields.values(), batch_id]
        if only_if:
            sql += f" AND status IN ({', '.join('?' for _ in only_if)})"
            args += list(only_if)
        with self._tx() as db:
            return db.execute(sql, args).rowcount == 1

    def finish_batch(self, batch_id: str, files: Sequence[dict[str, Any]], **fields: Any) -> bool:
        """Give a batch its final status (`fields`) and its output files (`files`: columns of a files row, the
        owner, creation time and order added here) their rows, in one transaction: a crash between the two would
        leave file rows whose batch still looks unfinished, and the restarted server would register them again.
        A batch already in a final status keeps it, and gets no files: returns whether it changed."""
        if "errors" in fields and fields["errors"] is not None:
            fields["errors"] = json.dumps([e.model_dump() for e in fields["errors"]])
        if "usage" in fields:  # a BatchUsage, kept as one column per count
            fields.update(usage_columns(fields.pop("usage")))
        final = tuple(FINAL_STATUSES)
        with self._tx() as db:
            row = db.execute(
                f"SELECT owner FROM batches WHERE id = ? AND status NOT IN ({', '.join('?' for _ in final)})",
                (batch_id, *final),
            ).fetchone()
            if row is None:
                return False
            now = int(time.time())
            # Output files live the batch's output_expires_after, counted from their own creation, as OpenAI's.
            lifetime = db.execute(
                "SELECT output_expires_seconds FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()[0]
            for file in files:
                seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM files").fetchone()[0]
                values = {**file, "owner": row["owner"], "created_at": now, "seq": seq}
                if lifetime is not None:
                    values.setdefault("expires_at", now + lifetime)
                db.execute(
                    f"INSERT INTO files ({', '.join(values)}) VALUES ({', '.join('?' for _ in values)})",
                    tuple(values.values()),
                )
            db.execute(
                f"UPDATE batches SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?",
                (*fields.values(), batch_id),
            )
        return True

    def _page(self, table, owner, after, limit, ascending, purpose, convert):  # noqa: ANN001 - internal
        where = ["owner = ?"]
        args: list[Any] = [owner]
        if table == "files":
            where.append(_LIVE)
            args.append(_now())
            if purpose:
                where.append("purpose = ?")
                args.append(purpose)
        if after:
            # A cursor is an id; another owner's id (or an unknown one) is no cursor at all: nothing follows it.
            cursor = self._one(f"SELECT seq FROM {table} WHERE id = ? AND owner = ?", (after, owner))
            if cursor is None:
                return [], False
            where.append(f"seq {'>' if ascending else '<'} ?")
            args.append(cursor["seq"])
        order = "ASC" if ascending else "DESC"
        rows = self._all(
            f"SELECT * FROM {table} WHERE {' AND '.join(where)} ORDER BY seq {order} LIMIT ?",
            (*args, limit + 1),
        )
        return [convert(r) for r in rows[:limit]], len(rows) > limit


def file_object(row: sqlite3.Row) -> FileObject:
    return FileObject(
        id=row["id"],
        bytes=row["bytes"],
        created_at=row["created_at"],
        filename=row["filename"],
        purpose=row["purpose"],
        status=row["status"],
        status_details=row["status_details"],
        expires_at=row["expires_at"],
    )


def usage_columns(usage: BatchUsage) -> dict[str, int]:
    return {
        "input_tokens": usage.input_tokens,
        "cached_tokens": usage.input_tokens_details.cached_tokens,
        "output_tokens": usage.output_tokens,
        "reasoning_tokens": usage.output_tokens_details.reasoning_tokens,
    }


def _usage(row: sqlite3.Row) -> BatchUsage | None:
    if row["input_tokens"] is None:
        return None
    return BatchUsage(
        input_tokens=row["input_tokens"],
        input_tokens_details=InputTokensDetails(cached_tokens=row["cached_tokens"] or 0),
        output_tokens=row["output_tokens"] or 0,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=row["reasoning_tokens"] or 0),
        total_tokens=row["input_tokens"] + (row["output_tokens"] or 0),
    )


def batch_object(row: sqlite3.Row) -> BatchObject:
    errors = json.loads(row["errors"]) if row["errors"] else None
    return BatchObject(
        id=row["id"],
        endpoint=row["endpoint"],
        errors=BatchErrors(data=[BatchError(**e) for e in errors]) if errors else None,
        input_file_id=row["input_file_id"],
        completion_window=row["completion_window"],
        status=row["status"],
        output_file_id=row["output_file_id"],
        error_file_id=row["error_file_id"],
        created_at=row["created_at"],
        request_counts=RequestCounts(total=row["total"], completed=row["completed"], failed=row["failed"]),
        metadata=json.loads(row["metadata"]) if row["metadata"] else None,
        model=row["model"],
        usage=_usage(row),
        **{k: row[k] for k in _TIMESTAMPS},
    )
