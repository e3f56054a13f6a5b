"""`OUTPUT/_staging/`: the job's checkpoint.

Finished rows (results and error records) are written here in small sorted Parquet parts, each one atomically, as
the job runs. Finalize reads only this directory, so whatever reached staging survives a crash of the driver and
`resume` can skip it.

    _staging/
      job.json                   the job state: spec, input fingerprint, fitted args (what `resume` re-reads)
      requests/part-*.parquet    validated requests, the engines' work list
      pending/part-*.parquet     on resume: the requests that still have no staged row
      results/*.parquet          finished result rows, each part sorted by custom_id
      errors/*.parquet           error records, each part sorted by source position
      ids/                       while ingest runs: custom_ids in hash buckets, for the duplicate check
      finalize/                  the final sort's plan, pieces and finished-shard records (runtime/commit/finalize.py)

One `StagingArea` works over a base path on one of two kinds of storage, chosen by the output location:
- `LocalFiles` (a local OUTPUT, and the local stand-in for an http(s):// OUTPUT, which cannot be listed): each part
  is written under a temporary name and renamed into place — atomic on POSIX.
- `ObjectStoreFiles` (s3://): an object is either whole or absent, so each part is one whole-object PUT — no temp
  name, no rename; every request is retried on transient errors. The checkpoint lives in the bucket, so `resume`
  works from any machine. Parts are immutable (every name is unique), so the ones this machine wrote or read are
  kept in a local read cache under the job's scratch directory: finalize reads each part from S3 at most once.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from pipeline.config import StorageConfig
from pipeline.io.locations import RetryPolicy, s3_filesystem, with_retries
from pipeline.local_files import fsync_path
from pipeline.state import JobState

T = TypeVar("T")

INGEST_PREFIX = "validate"  # error parts written by the validation pass (redone whole if it was interrupted)

STAGED_SCHEMA = pa.schema(
    [
        ("custom_id", pa.string()),
        ("line", pa.int64()),
        ("source", pa.string()),
        ("error_code", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("pool", pa.string()),
        ("record", pa.string()),  # the complete output line, JSON
        # Per-request latency, measured in the engine actor (null for rows no engine ran: ingest's error records,
        # and parts staged by a version that did not measure): seconds from the chunk's lease until the request
        # entered the engine, and seconds inside the engine until its answer.
        ("queue_wait_s", pa.float64()),
        ("engine_s", pa.float64()),
        # The name the request's `model` gave (a served model or a LoRA adapter; null for ingest's error records):
        # finalize counts rows and tokens per name.
        ("model", pa.string()),
        # For a result whose request asked for JSON output (response_format json_object / json_schema, or
        # structured_outputs json): whether every generated text parses as JSON; null for any other row. The
        # report counts them (observe/usage.py structured_of).
        ("structured_json", pa.bool_()),
    ]
)

# Columns added to STAGED_SCHEMA after jobs were already staged without them: read as nulls from older parts.
LATER_STAGED_COLUMNS = ("queue_wait_s", "engine_s", "model", "structured_json")

REQUEST_SCHEMA = pa.schema(
    [
        ("custom_id", pa.string()),
        ("url", pa.string()),
        ("body", pa.string()),  # JSON; Parquet structs would force one schema on every body
        ("line", pa.int64()),
        ("source", pa.string()),
        # Names the request's shared leading prompt (stages/prefix_key.py), null when it has none: the work queue sends
        # requests of one key to one engine, so that engine's prefix cache pays.
        ("prefix_key", pa.string()),
        # The served model the request runs on (its body's `model`): a job with one model per pool sends each
        # request only to the pools serving its model.
        ("model", pa.string()),
        # The output tokens the request asks for at most (its max_tokens, or the like), null when it sets none:
        # the work queue hands the job's last requests out longest first, so the job does not end waiting on a
        # long one that started last.
        ("output_budget", pa.int64()),
    ]
)


class JobStateError(ValueError):
    """`_staging/job.json` holds no job state this version can read."""


@dataclass
class StagedRow:
    custom_id: str | None
    line: int
    source: str
    error_code: str | None
    prompt_tokens: int
    completion_tokens: int
    pool: str
    record: str
    queue_wait_s: float | None = None
    engine_s: float | None = None
    model: str | None = None
    structured_json: bool | None = None


def _is_part(name: str) -> bool:
    return name.endswith(".parquet") and not name.startswith(".")


# -- the storage under a staging area ---------------------------------------------------------------------------------


class PartFiles(Protocol):
    """The few file operations staging needs; paths are plain strings (`/abs/path` or `bucket/key`)."""

    def url(self, path: str) -> str: ...
    def makedirs(self, path: str) -> None: ...
    def exists(self, path: str) -> bool: ...
    def list_parts(self, directory: str) -> list[str]: ...
    def write_parquet(self, table: pa.Table, path: str) -> None: ...
    def write_bytes(self, path: str, data: bytes) -> None: ...
    def read_bytes(self, path: str) -> bytes: ...
    def parquet(self, path: str) -> pq.ParquetFile: ...
    def delete(self, paths: list[str]) -> None: ...
    def delete_tree(self, path: str) -> None: ...


def _write_parquet_atomic(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        pq.write_table(table, tmp, compression="zstd")
        # Its bytes reach the disk before its name does: after a power cut a part is whole or absent (and an
        # absent one is run again on resume), never a torn file under a part's name.
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


class LocalFiles:
    """Local disk: parts are written under a temporary name, then renamed into place (atomic on POSIX)."""

    def url(self, path: str) -> str:
        return path

    def arrow_filesystem(self) -> Any:
        """The same storage for readers that take a pyarrow filesystem (Ray Data)."""
        import pyarrow.fs

        return pyarrow.fs.LocalFileSystem()

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def list_parts(self, directory: str) -> list[str]:
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return []
        return sorted(os.path.join(directory, name) for name in names if _is_part(name))

    def write_parquet(self, table: pa.Table, path: str) -> None:
        _write_parquet_atomic(table, Path(path))

    def write_bytes(self, path: str, data: bytes) -> None:
        from pipeline.local_files import atomic_write_bytes

        atomic_write_bytes(Path(path), data)

    def read_bytes(self, path: str) -> bytes:
        return Path(path).read_bytes()

    def parquet(self, path: str) -> pq.ParquetFile:
        return pq.ParquetFile(path)

    def delete(self, paths: list[str]) -> None:
        for path in paths:
            Path(path).unlink(missing_ok=True)

    def delete_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


class ObjectStoreFiles:
    """S3 (s3fs): every part is one whole-object PUT, atomic by itself; every request is retried with backoff.

    Staged objects are immutable (unique names), so what this machine wrote or fetched is kept in `cache_dir` on
    local disk and read from there: scratch, not checkpoint — the bucket stays the truth (listings always ask it).
    Pickles without its client (Ray ships it to the work-queue actor), which is rebuilt from `storage` on use.
    """

    def __init__(self, storage: StorageConfig, cache_dir: Path, fs: Any = None) -> None:
        self.storage = storage
        self.policy = RetryPolicy.from_config(storage)
        self.cache_dir = cache_dir
        self._fs = fs

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}

    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs = s3_filesystem(self.storage)
        return self._fs

    def url(self, path: str) -> str:
        return f"s3://{path}"

    def arrow_filesystem(self) -> Any:
        """The same bucket for readers that take a pyarrow filesystem (Ray Data): paths stay `bucket/key`."""
        import pyarrow.fs

        return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(self.fs))

    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        return with_retries(fn, f"{op} {self.url(path)}", self.policy)

    def _cached(self, path: str) -> Path:
        return self.cache_dir / path

    def _remember(self, path: str, data: bytes) -> None:
        from pipeline.local_files import atomic_write_bytes

        try:
            atomic_write_bytes(self._cached(path), data)
        except OSError:  # a cache that cannot be written (disk full) only costs a GET later
            pass

    def makedirs(self, path: str) -> None:
        pass  # a prefix exists once an object is under it

    def exists(self, path: str) -> bool:
        return bool(self._ls(path))

    def _ls(self, path: str) -> list[str]:
        def listing() -> list[str]:
            try:
                return self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []

        return self._call("LIST", path, listing)

    def list_parts(self, directory: str) -> list[str]:
        return sorted(p for p in self._ls(directory) if _is_part(p.rsplit("/", 1)[-1]))

    def write_parquet(self, table: pa.Table, path: str) -> None:
        data = _parquet_bytes(table)
        self.write_bytes(path, data)
        self._remember(path, data)

    def write_bytes(self, path: str, data: bytes) -> None:
        self._call("PUT", path, lambda: self.fs.pipe_file(path, data))

    def read_bytes(self, path: str) -> bytes:
        return self._call("GET", path, lambda: self.fs.cat_file(path))

    def parquet(self, path: str) -> pq.ParquetFile:
        cached = self._cached(path)
        if not cached.exists():
            data = self.read_bytes(path)
            self._remember(path, data)
            if not cached.exists():
                return pq.ParquetFile(pa.BufferReader(data))
        return pq.ParquetFile(cached)

    def delete(self, paths: list[str]) -> None:
        if paths:
            self._call("DELETE", paths[0], lambda: self._rm(paths))
            for path in paths:
                self._cached(path).unlink(missing_ok=True)

    def delete_tree(self, path: str) -> None:
        self._call("DELETE", path, lambda: self._rm(path, recursive=True))
        shutil.rmtree(self._cached(path), ignore_errors=True)

    def _rm(self, what: str | list[str], recursive: bool = False) -> None:
        try:
            self.fs.rm(what, recursive=recursive)
        except FileNotFoundError:  # already gone (e.g. a retried delete that had gone through)
            pass


# -- the staging area -------------------------------------------------------------------------------------------------


class StagingArea:
    """`<output>/_staging/` on `files` (local disk unless told otherwise).

    `scratch` is local disk for temporary files that are not part of the checkpoint; by default the staging
    directory itself.
    """

    def __init__(
        self, output_dir: Path | str, files: PartFiles | None = None, scratch: Path | None = None
    ) -> None:
        self.files: PartFiles = files or LocalFiles()
        self.root = f"{str(output_dir).rstrip('/')}/_staging"
        self.scratch = scratch or Path(self.root)
        self.job_file = f"{self.root}/job.json"
        self.requests_dir = f"{self.root}/requests"
        self.pending_dir = f"{self.root}/pending"
        self.results_dir = f"{self.root}/results"
        self.errors_dir = f"{self.root}/errors"
        self.ids_dir = f"{self.root}/ids"
        # A dataset job's input rows (the columns its output keeps), staged at ingest for finalize to join.
        self.rows_dir = f"{self.root}/rows"
        self.finalize_dir = f"{self.root}/finalize"
        self._writer_id = uuid.uuid4().hex[:8]
        self._seq = 0

    @property
    def is_local(self) -> bool:
        """On this machine's disk (other hosts of a cluster cannot write it)."""
        return isinstance(self.files, LocalFiles)

    def describe(self) -> str:
        """Where the checkpoint is, for messages: a local path or an s3:// URL."""
        return self.files.url(self.root)

    def create(self) -> None:
        for d in (self.requests_dir, self.results_dir, self.errors_dir):
            self.files.makedirs(d)

    def exists(self) -> bool:
        return self.files.exists(self.root)

    def discard(self) -> None:
        """Remove the whole checkpoint (after the commit)."""
        self.files.delete_tree(self.root)

    # -- the job spec -----------------------------------------------------------------------------------------
    def write_job(self, job: JobState) -> None:
        data = job.model_dump(mode="json")
        self.files.write_bytes(
            self.job_file, (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode()
        )

    def read_job(self) -> JobState:
        """The job state; a JobStateError names the file when it is not one this version can read."""
        try:
            data = self.files.read_bytes(self.job_file)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self.files.url(self.job_file)} is missing: this is not a resumable nightshift job"
            ) from None
        try:
            return JobState.model_validate_json(data)
        except ValidationError as exc:
            raise JobStateError(
                f"{self.files.url(self.job_file)} is not a nightshift job state this version can resume: {exc}"
            ) from None

    def discard_ingest(self) -> None:
        """Drop a partial validation pass (its work list, its error parts, its id buckets) so it can be redone
        whole."""
        self.files.delete(
            [
                *self.files.list_parts(self.requests_dir),
                *(p for p in self.parts("errors") if _name(p).startswith(f"{INGEST_PREFIX}-")),
                *self.files.list_parts(self.rows_dir),
            ]
        )
        self.files.delete_tree(self.ids_dir)

    def _next_name(self, prefix: str) -> str:
        self._seq += 1
        return f"{prefix}-{self._writer_id}-{self._seq:06d}.parquet"

    # -- requests (the work list) --------------------------------------------------------------------------
    def write_requests(self, rows: list[dict[str, Any]] | pa.Table, name: str | None = None) -> None:
        """One part of the work list; `name` fixes its file name (a task that is run again replaces its part)."""
        if len(rows):
            table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=REQUEST_SCHEMA)
            self.files.write_parquet(table, f"{self.requests_dir}/{name or self._next_name('part')}")

    def request_files(self) -> list[str]:
        return self.files.list_parts(self.requests_dir)

    def pending_requests(self, finished: set[str]) -> list[str]:
        """The request parts still to run: all of them on a fresh job; on resume, filtered copies (under
        `pending/`) without the requests that already have a staged row, so finished work is never recomputed."""
        files = self.request_files()
        if not finished:
            return files
        import pyarrow.compute as pc

        self.files.delete_tree(self.pending_dir)  # an earlier resume's list, now out of date
        done = pa.array(sorted(finished), type=pa.string())
        pending = []
        for path in files:
            table = self.files.parquet(path).read()
            left = table.filter(pc.invert(pc.is_in(table.column("custom_id"), value_set=done)))
            if left.num_rows:
                target = f"{self.pending_dir}/{self._next_name('part')}"
                self.files.makedirs(self.pending_dir)
                self.files.write_parquet(left, target)
                pending.append(target)
        return pending

    def requests_for_model(self, paths: list[str], names: list[str]) -> list[str]:
        """Copies (under `pending/`) of the request parts holding only the requests naming one of `names` (a
        model and its LoRA adapters): the work list of the pools that serve that model, in a job that serves
        several models. Memory: one part at a time."""
        import pyarrow as pa
        import pyarrow.compute as pc

        out = []
        for path in paths:
            table = self.files.parquet(path).read()
            if "model" not in table.column_names:  # staged before requests named their model: the job's own
                continue
            mine = table.filter(pc.is_in(table.column("model"), value_set=pa.array(names, pa.string())))
            if mine.num_rows:
                target = f"{self.pending_dir}/{self._next_name('part')}"
                self.files.makedirs(self.pending_dir)
                self.files.write_parquet(mine, target)
                out.append(target)
        return out

    def num_rows(self, paths: Iterable[str]) -> int:
        return sum(self.files.parquet(p).metadata.num_rows for p in paths)

    def drop_requests(self, path: str, custom_ids: set[str]) -> None:
        """Rewrite one request part without the given requests (one atomic write or whole-object put; an
        emptied part is removed). Memory: one part of the work list."""
        import pyarrow.compute as pc

        drop = pa.array(sorted(custom_ids), type=pa.string())
        table = self.files.parquet(path).read()
        left = table.filter(pc.invert(pc.is_in(table.column("custom_id"), value_set=drop)))
        if left.num_rows:
            self.files.write_parquet(left, path)
        else:
            self.files.delete([path])

    # -- finished rows ----------------------------------------------------------------------------------------
    def write_rows(
        self, kind: str, rows: list[StagedRow], prefix: str | None = None, name: str | None = None
    ) -> None:
        """Persist finished rows as one sorted part; after this returns they survive any crash.

        `name` fixes the part's file name, so a pass that is redone replaces its part instead of adding a copy.
        """
        if rows:
            table = pa.Table.from_pylist([r.__dict__ for r in rows], schema=STAGED_SCHEMA)
            self.write_table(kind, table, prefix, name)

    def write_table(
        self, kind: str, table: pa.Table, prefix: str | None = None, name: str | None = None
    ) -> None:
        """`write_rows` for rows already in Arrow (the engines' output): sorted in Arrow, no per-row Python.

        Arrow orders strings by their UTF-8 bytes, which is code point order: the same order as result_sort_key."""
        if not table.num_rows:
            return
        table = with_later_columns(table).select(STAGED_SCHEMA.names).cast(STAGED_SCHEMA)
        keys = (
            [("custom_id", "ascending")]
            if kind == "results"
            else [("source", "ascending"), ("line", "ascending")]
        )
        target = f"{self._dir(kind)}/{name or self._next_name(prefix or kind)}"
        self.files.write_parquet(table.sort_by(keys), target)

    def engine_parts(self) -> list[str]:
        """The parts engines staged (results and engine-side errors), not those of ingest's error records."""
        return [
            part
            for kind in ("results", "errors")
            for part in self.parts(kind)
            if not _name(part).startswith(f"{INGEST_PREFIX}-")
        ]

    def finished_ids(self) -> Iterator[str]:
        """custom_ids that already have their final row from an engine (results and engine-side errors)."""
        for part in self.engine_parts():
            yield from self.read_part(part, ["custom_id"]).column("custom_id").to_pylist()

    def write_kept_rows(self, table: pa.Table, name: str) -> None:
        """One part of a dataset job's input rows: `custom_id`, `source`, `line` and a struct `row` of the kept
        columns, as read (types and all). `name` is fixed, so a read task that runs again replaces its part."""
        if table.num_rows:
            self.files.makedirs(self.rows_dir)
            self.files.write_parquet(table, f"{self.rows_dir}/{name}")

    def _dir(self, kind: str) -> str:
        return {"results": self.results_dir, "errors": self.errors_dir, "rows": self.rows_dir}[kind]

    def parts(self, kind: str) -> list[str]:
        return self.files.list_parts(self._dir(kind))

    def read_part(self, path: str, columns: list[str] | None = None) -> pa.Table:
        # ParquetFile.read is several times cheaper per small file than read_table (no dataset machinery), and the
        # parts are too small for threads to pay.
        return self.files.parquet(path).read(columns=columns, use_threads=False)

    def count(self, kind: str) -> int:
        return self.num_rows(self.parts(kind))

    def iter_column(self, kind: str, column: str) -> Iterator[Any]:
        for part in self.parts(kind):
            yield from self.read_part(part, [column]).column(column).to_pylist()


def with_later_columns(table: pa.Table) -> pa.Table:
    """`table` with the STAGED_SCHEMA columns added since it was written, as nulls (a part staged by an older
    version, read on resume)."""
    for name in LATER_STAGED_COLUMNS:
        if name not in table.column_names:
            field = STAGED_SCHEMA.field(name)
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table


def _name(path: str) -> str:
    return path.rsplit("/", 1)[-1]
