"""`OUTPUT/_staging/`: the job's checkpoint.

Finished rows (results and error records) are written here in small sorted Parquet parts, each one atomically
(temp file + rename), as the job runs. Finalize reads only this directory, so whatever reached staging survives a
crash of the driver and `resume` can skip it.

    _staging/
      job.json             the job spec + input fingerprint (what `resume` re-reads)
      requests/part-*.parquet   validated requests, the engines' work list
      results/*.parquet    finished result rows, each part sorted by custom_id
      errors/*.parquet     error records, each part sorted by source position
"""

from __future__ import annotations

import heapq
import json
import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

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
    ]
)

REQUEST_SCHEMA = pa.schema(
    [
        ("custom_id", pa.string()),
        ("url", pa.string()),
        ("body", pa.string()),  # JSON; Parquet structs would force one schema on every body
        ("line", pa.int64()),
        ("source", pa.string()),
    ]
)


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


def result_sort_key(row: StagedRow) -> str:
    # Python compares str by code point, which is exactly UTF-8 byte order (the contract's order).
    return row.custom_id or ""


def error_sort_key(row: StagedRow) -> tuple[str, int]:
    return (row.source, row.line)


def _write_parquet_atomic(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class StagingArea:
    def __init__(self, output_dir: Path) -> None:
        self.root = output_dir / "_staging"
        self.job_file = self.root / "job.json"
        self.requests_dir = self.root / "requests"
        self.results_dir = self.root / "results"
        self.errors_dir = self.root / "errors"
        self._writer_id = uuid.uuid4().hex[:8]
        self._seq = 0

    def create(self) -> None:
        for d in (self.requests_dir, self.results_dir, self.errors_dir):
            d.mkdir(parents=True, exist_ok=True)

    def exists(self) -> bool:
        return self.root.exists()

    # -- the job spec -----------------------------------------------------------------------------------------
    def write_job(self, job: dict[str, Any]) -> None:
        from pipeline.io.files import atomic_write_json

        atomic_write_json(self.job_file, job)

    def read_job(self) -> dict[str, Any]:
        if not self.job_file.exists():
            raise FileNotFoundError(f"{self.job_file} is missing: this is not a resumable nightshift job")
        return json.loads(self.job_file.read_text())

    def discard_ingest(self) -> None:
        """Drop a partial validation pass (its work list and its error parts) so it can be redone whole."""
        for part in [
            *self.requests_dir.glob("*.parquet"),
            *self.errors_dir.glob(f"{INGEST_PREFIX}-*.parquet"),
        ]:
            part.unlink()

    def _next_name(self, prefix: str) -> str:
        self._seq += 1
        return f"{prefix}-{self._writer_id}-{self._seq:06d}.parquet"

    # -- requests (the work list) --------------------------------------------------------------------------
    def write_requests(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            table = pa.Table.from_pylist(rows, schema=REQUEST_SCHEMA)
            _write_parquet_atomic(table, self.requests_dir / self._next_name("part"))

    def request_files(self) -> list[str]:
        return sorted(str(p) for p in self.requests_dir.glob("*.parquet"))

    def drop_requests(self, path: str | Path, custom_ids: set[str]) -> None:
        """Rewrite one request part without the given requests (atomically; an emptied part is removed).

        Streams the part a read batch at a time, so memory stays one batch whatever the part's size.
        """
        import pyarrow.compute as pc

        path = Path(path)
        drop = pa.array(sorted(custom_ids), type=pa.string())
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        kept = 0
        try:
            with pq.ParquetWriter(tmp, REQUEST_SCHEMA, compression="zstd") as writer:
                for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
                    left = batch.filter(pc.invert(pc.is_in(batch.column("custom_id"), value_set=drop)))
                    kept += left.num_rows
                    writer.write_batch(left)
            if kept:
                os.replace(tmp, path)
            else:
                tmp.unlink()
                path.unlink()
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    # -- finished rows ----------------------------------------------------------------------------------------
    def write_rows(
        self, kind: str, rows: list[StagedRow], prefix: str | None = None, name: str | None = None
    ) -> None:
        """Persist finished rows as one sorted part; after this returns they survive any crash.

        `name` fixes the part's file name, so a pass that is redone replaces its part instead of adding a copy.
        """
        if not rows:
            return
        key = result_sort_key if kind == "results" else error_sort_key
        rows = sorted(rows, key=key)
        table = pa.Table.from_pylist([r.__dict__ for r in rows], schema=STAGED_SCHEMA)
        _write_parquet_atomic(table, self._dir(kind) / (name or self._next_name(prefix or kind)))

    def finished_ids(self) -> Iterator[str]:
        """custom_ids that already have their final row from an engine (results and engine-side errors)."""
        yield from self.iter_column("results", "custom_id")
        for part in self.parts("errors"):
            if not part.name.startswith(f"{INGEST_PREFIX}-"):
                yield from pq.read_table(part, columns=["custom_id"]).column("custom_id").to_pylist()

    def _dir(self, kind: str) -> Path:
        return self.results_dir if kind == "results" else self.errors_dir

    def parts(self, kind: str) -> list[Path]:
        return sorted(self._dir(kind).glob("*.parquet"))

    def count(self, kind: str) -> int:
        return sum(pq.ParquetFile(p).metadata.num_rows for p in self.parts(kind))

    def column_sum(self, column: str) -> int:
        """Sum of a numeric column over every staged row (results and errors) — e.g. tokens across resumes."""
        import pyarrow.compute as pc

        total = 0
        for kind in ("results", "errors"):
            for part in self.parts(kind):
                total += pc.sum(pq.read_table(part, columns=[column]).column(column)).as_py() or 0
        return total

    def iter_column(self, kind: str, column: str) -> Iterator[Any]:
        for part in self.parts(kind):
            yield from pq.read_table(part, columns=[column]).column(column).to_pylist()

    def merged(self, kind: str) -> Iterator[StagedRow]:
        """All staged rows of `kind` in final order: a k-way merge of the sorted parts, streaming.

        Memory is one read batch per part, not the whole output — this is what keeps finalize bounded.
        """
        key = result_sort_key if kind == "results" else error_sort_key
        return heapq.merge(*(_iter_part(p) for p in self.parts(kind)), key=key)


def _iter_part(path: Path, batch_size: int = 2048) -> Iterable[StagedRow]:
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
        columns = batch.to_pydict()
        for values in zip(*(columns[name] for name in STAGED_SCHEMA.names), strict=True):
            yield StagedRow(*values)
