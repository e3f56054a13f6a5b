"""Finalize: staging → sorted result shards, error shards, then `manifest.json` (the commit marker), then drop
`_staging/`. Reads only staging, so it can be re-run after a crash at any point.

The sort is external, with memory bounded by one shard (rows_per_shard rows) plus the sort keys:
1. read only the key columns of every staged part (custom_id, or source + line) and derive exact shard
   boundaries — shard k holds rows [k*rows_per_shard, (k+1)*rows_per_shard) of the sorted order;
2. stream the staged parts once, routing every row to a per-shard spill file (Arrow IPC, on local disk: under
   `_staging/` for a local OUTPUT, in the job's local scratch directory for a remote one);
3. per shard: load its spill file, sort it, write the shard through the format's encoder, delete the spill.
All of it runs in Arrow (C++); no Python object per row except for Parquet output's flattened columns.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import structlog

from pipeline.io.files import atomic_write_json
from pipeline.io.staging import StagingArea
from pipeline.io.writers import MANIFEST_NAME, OutputTarget, output_target, shard_encoder
from pipeline.stages.finalize import (
    Partitioning,
    ShardInfo,
    plan_partitioning,
    sort_table,
    split_by_shard,
    write_table_shards,
)

log = structlog.get_logger(__name__)

__all__ = ["MANIFEST_NAME", "FORMAT_VERSION", "AccountingError", "write_outputs", "commit"]

FORMAT_VERSION = 1
MAX_OPEN_SPILLS = 128  # shards routed per pass over the staged parts (open files)
SPILL_FLUSH_BYTES = 64 << 20  # buffered spill rows across all open shards before they are written out
KEY_COLUMNS = {"results": ["custom_id"], "errors": ["source", "line"]}
READ_COLUMNS = ["custom_id", "source", "line", "record"]
SPILL_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")


class AccountingError(RuntimeError):
    """Staged rows do not add up to the input: the job is not committed."""


def _as_target(output: Path | str | OutputTarget) -> OutputTarget:
    return output if isinstance(output, OutputTarget) else output_target(str(output))


def remove_previous_outputs(output: Path | str | OutputTarget) -> None:
    """A re-run finalize (or --overwrite) must not leave shards of another shard count behind."""
    _as_target(output).remove_previous_outputs()


def _read_columns(staging: StagingArea, parts: list[str], columns: list[str]) -> pa.Table:
    tables = [staging.read_part(p, columns) for p in parts]
    if not tables:
        return pa.table({c: pa.array([], pa.int64() if c == "line" else pa.string()) for c in columns})
    return pa.concat_tables(tables)


class _SpillSet:
    """Per-shard Arrow IPC spill files for shards [first, last), with bounded buffering."""

    def __init__(self, spill_dir: Path, first: int, last: int, schema: pa.Schema) -> None:
        self.spill_dir = spill_dir
        self.first, self.last = first, last
        self.schema = schema
        self._writers: dict[int, Any] = {}
        self._buffers: dict[int, list[pa.Table]] = {}
        self._buffered = 0

    def path(self, shard: int) -> Path:
        return self.spill_dir / f"shard-{shard:05d}.arrow"

    def add(self, shard: int, table: pa.Table) -> None:
        self._buffers.setdefault(shard, []).append(table)
        self._buffered += table.nbytes
        if self._buffered >= SPILL_FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        for shard, tables in self._buffers.items():
            writer = self._writers.get(shard)
            if writer is None:
                writer = pa.ipc.new_stream(str(self.path(shard)), self.schema, options=SPILL_OPTIONS)
                self._writers[shard] = writer
            writer.write_table(pa.concat_tables(tables).combine_chunks())
        self._buffers.clear()
        self._buffered = 0

    def close(self) -> None:
        self.flush()
        for writer in self._writers.values():
            writer.close()


def sorted_shard_tables(
    staging: StagingArea, kind: str, rows_per_shard: int, spill_dir: Path
) -> tuple[int, Iterator[pa.Table]]:
    """(row count, one sorted table per shard in order). Raises AccountingError on a result id staged twice."""
    parts = staging.parts(kind)
    keys = _read_columns(staging, parts, KEY_COLUMNS[kind])
    try:
        plan: Partitioning = plan_partitioning(keys, kind, rows_per_shard)
    except ValueError as exc:
        raise AccountingError(str(exc)) from exc
    total = keys.num_rows
    del keys

    def single() -> Iterator[pa.Table]:
        yield sort_table(_read_columns(staging, parts, READ_COLUMNS), kind)

    def spilled() -> Iterator[pa.Table]:
        spill_dir.mkdir(parents=True, exist_ok=True)
        try:
            for first in range(0, plan.count, MAX_OPEN_SPILLS):
                last = min(plan.count, first + MAX_OPEN_SPILLS)
                spills: _SpillSet | None = None
                for part in parts:
                    table = staging.read_part(part, READ_COLUMNS)
                    if spills is None:
                        spills = _SpillSet(spill_dir, first, last, table.schema)
                    for shard, rows in split_by_shard(table, plan.assign(table)).items():
                        if first <= shard < last:
                            spills.add(shard, rows)
                if spills is not None:
                    spills.close()
                for shard in range(first, last):
                    path = spills.path(shard) if spills else None
                    if path is None or not path.exists():
                        continue  # no rows: write_table_shards reports the count mismatch
                    with pa.OSFile(str(path), "rb") as fh:
                        table = pa.ipc.open_stream(fh).read_all()
                    path.unlink()
                    yield sort_table(table, kind)
        finally:
            shutil.rmtree(spill_dir, ignore_errors=True)

    if total == 0:
        return 0, iter(())
    return total, (single() if plan.count == 1 else spilled())


def write_outputs(
    output: Path | str | OutputTarget,
    staging: StagingArea,
    rows_per_shard: int,
    expected_rows: int,
    format: str = "jsonl",
) -> dict[str, Any]:
    """Write the shards; returns counts and shard descriptions for the manifest."""
    target = _as_target(output)
    n_results = staging.count("results")
    n_errors = staging.count("errors")
    if n_results + n_errors != expected_rows:
        raise AccountingError(
            f"staging holds {n_results} results + {n_errors} errors = {n_results + n_errors} rows, "
            f"but the input has {expected_rows}; output not committed"
        )
    by_code = Counter(code for code in staging.iter_column("errors", "error_code"))
    encoder, extension = shard_encoder(format)

    # Plan both sorts before touching OUTPUT: a duplicate result id fails here, with nothing removed or written.
    written: dict[str, list[ShardInfo]] = {}
    plans = {
        kind: sorted_shard_tables(staging, kind, rows_per_shard, staging.scratch / f"finalize-{kind}")
        for kind in ("results", "errors")
    }
    target.remove_previous_outputs()
    for kind, (total, tables) in plans.items():
        written[kind] = write_table_shards(
            tables, total, rows_per_shard, kind, target.open_write, encoder, extension
        )
    return {
        "counts": {
            "total": expected_rows,
            "succeeded": n_results,
            "failed": n_errors,
            "by_error_code": dict(sorted(by_code.items())),
        },
        "shards": {kind: [s.as_manifest() for s in shards] for kind, shards in written.items()},
    }


def commit(output: Path | str | OutputTarget, staging: StagingArea, manifest: dict[str, Any]) -> None:
    """The manifest is written last and atomically: its presence means every shard is complete. Then `_staging/`
    goes (wherever it lives: OUTPUT, the bucket, or this machine's disk for an http(s):// output)."""
    target = _as_target(output)
    if target.is_local:
        atomic_write_json(Path(target.location.path) / MANIFEST_NAME, manifest)
    else:
        target.put_bytes(MANIFEST_NAME, (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode())
    try:
        staging.discard()
    except Exception as exc:  # noqa: BLE001 - committed all the same: a leftover checkpoint is clutter, not harm
        log.warning(
            "the job is committed, but its staging could not be removed; delete it by hand",
            staging=staging.describe(),
            error=f"{type(exc).__name__}: {exc}",
        )
    target.discard_scratch()
