"""Finalize: staging → sorted result shards, error shards, then `manifest.json` (the commit marker), then drop
`_staging/`. A range-partitioned sort that runs as tasks on the cluster; every task reads and writes through the
staging area's storage (local disk or the bucket), so a finalize cut short is resumed where it stopped.

1. plan — the driver reads the row count of every staged part (Parquet metadata) and the sort keys of a bounded
   sample of parts, and cuts the key space into about one bucket per shard. Key tasks (one per group of
   consecutive parts) read only the key columns and write each bucket's keys under `_staging/finalize/keys/`; a cut
   task per bucket sorts them, finds a result id staged twice, and returns the keys at the sorted positions
   k*rows_per_shard that fall in its bucket. So the shard boundaries are exact (every shard but the last holds
   rows_per_shard rows) while the driver holds the sample, counts and one key per shard — never every id.
   Then the previous job's shards go, and the plan is written to `_staging/finalize/plan.json`: from here on
   OUTPUT holds only this job's shards.
2. map — one task per group of parts: read them, route every row to its shard by the boundary keys, write the
   rows of each shard as a piece (Arrow IPC) under `_staging/finalize/pieces/`, then record its pieces.
3. reduce — one task per shard: read its pieces, sort, reject a duplicate id, write the shard to OUTPUT through
   the format's encoder, then record its ShardInfo (rows, first/last id, sha256, bytes) under `done/`.
With a single shard there is nothing to route: its reduce reads the staged parts themselves.

A resumed finalize keeps the plan (when the staged parts, rows_per_shard and format still match), the groups
already mapped and the shards already recorded, and runs the rest. Every task's writes are idempotent (fixed names,
whole-file replaces), so a task Ray re-runs after a lost node does no harm.

The tasks are plain functions of (context, item), run by runtime/hosting/executor.py: Ray tasks of one CPU each when Ray is
up. With a local path involved (local staging or a local OUTPUT) on a cluster that spans several hosts, they are
pinned to the driver's node, the only one that sees that disk (in the driver itself when that node offers Ray no
CPUs); otherwise Ray spreads them. Without Ray (finalize called on its own, as in unit tests) the same task
functions run one after another here.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import structlog

from pipeline.config import StorageConfig
from pipeline.datasets.output import TableOutput
from pipeline.io.encoders import ShardInfo
from pipeline.io.locations import Location
from pipeline.io.staging import STAGED_SCHEMA, LocalFiles, PartFiles, StagingArea, with_later_columns
from pipeline.io.writers import MANIFEST_NAME, OutputTarget, output_target, shard_encoder
from pipeline.local_files import atomic_write_json, fsync_path
from pipeline.manifest import Counts, Manifest, Shards, StructuredCounts, Tokens
from pipeline.runtime.hosting.executor import IN_PROCESS, TaskExecutor, ray_placement
from pipeline.stages.shard import (
    assign_shards,
    cut_ranks,
    evenly_spaced,
    first_duplicate,
    group_parts,
    locate_cuts,
    shard_count,
    shard_name,
    sort_keys,
    sort_table,
    split_by_shard,
    splitters,
    write_shard,
)

log = structlog.get_logger(__name__)

__all__ = ["MANIFEST_NAME", "FORMAT_VERSION", "AccountingError", "FinalizeOutputs", "write_outputs", "commit"]

FORMAT_VERSION = 1
PLAN_VERSION = 1
KINDS = ("results", "errors")
# A dataset job writes one table instead: its answers and errors together ("table", staged as results and errors),
# each joined in its shard with its input row's kept columns ("rows", staged at ingest) — routed by the same
# boundaries, so a row and its answer always meet in one reduce task.
MAP_TASK_ROWS = 100_000  # staged rows per key / map task (a group of consecutive parts) ...
MAX_MAP_TASKS = 256  # ... more per task beyond this many, so a shard has at most this many groups' pieces
ROUTE_ROWS = 65_536  # staged rows routed at once: parts are small, and one Arrow pass over many is cheaper
SPILL_FLUSH_BYTES = 64 << 20  # rows a map task holds before it writes them out (one piece per shard)
SAMPLE_PARTS = 128  # staged parts the driver reads keys from to place the buckets ...
SAMPLE_KEYS_PER_BUCKET = 64  # ... and how many keys it takes per bucket (at most MAX_SAMPLE_PER_PART a part)
MAX_SAMPLE_PER_PART = 4096
KEY_COLUMNS = {
    "results": ["custom_id"],
    "errors": ["source", "line"],
    "table": ["custom_id", "source", "line"],
    "rows": ["custom_id", "source", "line"],
}
# The token columns ride along so each shard's task sums them: the manifest's totals (across resumes too) cost the
# driver nothing.
# So do the latency columns: each shard's task histograms its rows' usage (observe/usage.py), and Parquet shards
# carry them per request.
READ_COLUMNS = [
    "custom_id",
    "source",
    "line",
    "error_code",
    "prompt_tokens",
    "completion_tokens",
    "record",
    "queue_wait_s",
    "engine_s",
    "model",
    "structured_json",
]
ROWS_COLUMNS = ["custom_id", "source", "line", "row"]
PIECE_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")


def _columns(kind: str) -> list[str]:
    return ROWS_COLUMNS if kind == "rows" else READ_COLUMNS


class AccountingError(RuntimeError):
    """Staged rows do not add up to the input: the job is not committed."""


@dataclass(frozen=True)
class FinalizeOutputs:
    """What finalize wrote (write_outputs): the manifest's counts, shards and tokens as they are written, and what
    the job's manifest and report derive from the shards' records."""

    # Rows by outcome (total = succeeded + failed), error rows per code, structured (JSON) output asked for and
    # parsed: the manifest's `counts`.
    counts: Counts
    # Every shard written, per kind in order: name, rows, first/last custom_id, bytes, sha256 (`shards`).
    shards: Shards
    # Prompt and completion tokens of every row written (`tokens`).
    tokens: Tokens
    # Per-request usage of the result rows, as histograms (observe/usage.py): the manifest's percentiles and the
    # report's length charts.
    usage_histograms: dict[str, dict[str, Any]]
    # Rows and tokens per name the requests gave in `model` (a served model or a LoRA adapter): the rows an engine
    # answered, results and the engine's error records alike (the manifest's `models`).
    rows_by_model: dict[str, dict[str, int]]
    # Which nodes ran finalize's tasks (a node id's first 8 characters, or "driver") and how many, this attempt
    # only (the manifest's `placement.finalize`).
    tasks_by_node: dict[str, int]

    def manifest_fields(self) -> dict[str, Any]:
        """`counts`, `shards` and `tokens` as manifest.json holds them: the manifest of finalize used on its own."""
        return {
            "counts": self.counts.model_dump(mode="json"),
            "shards": self.shards.model_dump(mode="json"),
            "tokens": self.tokens.model_dump(mode="json"),
        }


def _as_target(output: Path | str | OutputTarget) -> OutputTarget:
    return output if isinstance(output, OutputTarget) else output_target(str(output))


def remove_previous_outputs(output: Path | str | OutputTarget) -> None:
    """A re-run finalize (or --overwrite) must not leave shards of another shard count behind."""
    _as_target(output).remove_previous_outputs()


# -- what every task works with ---------------------------------------------------------------------------------------


@dataclass
class _Context:
    """The staging storage, finalize's directory in it, and the output: picklable, so Ray ships it to the tasks
    (which rebuild the output target from its location)."""

    files: PartFiles
    root: str  # `<OUTPUT>/_staging/finalize`
    location: Location
    storage: StorageConfig
    format: str
    driver_host: str | None = None  # the driver's node address, when tasks run on Ray
    table: TableOutput | None = (
        None  # a dataset job's table (datasets/output.py): its route, how JSON is parsed
    )
    _target: OutputTarget | None = field(default=None, repr=False)
    # Staged parts in a bucket go through the driver's read cache (see staging.ObjectStoreFiles) only on the
    # driver's host, where the commit clears it; a task on another host leaves nothing behind.
    _cached_reads: bool = True

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_target": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._cached_reads = self.driver_host is not None and _this_host() == self.driver_host

    def target(self) -> OutputTarget:
        if self._target is None:
            self._target = output_target(self.location, self.storage)
        return self._target

    # Fixed names: a task that runs again replaces its files instead of adding to them.
    def plan_path(self) -> str:
        return f"{self.root}/plan.json"

    def key_piece(self, kind: str, bucket: int, group: int) -> str:
        return f"{self.root}/keys/{kind}/b{bucket:05d}-g{group:05d}.arrow"

    def piece(self, kind: str, shard: int, group: int, seq: int) -> str:
        return f"{self.root}/pieces/{kind}/s{shard:05d}-g{group:05d}-{seq:04d}.arrow"

    def mapped_record(self, kind: str, group: int) -> str:
        return f"{self.root}/mapped/{kind}-g{group:05d}.json"

    def done_record(self, kind: str, shard: int) -> str:
        return f"{self.root}/done/{kind}-{shard:05d}.json"

    def read(self, path: str, columns: list[str]) -> pa.Table:
        """A staged part (Parquet) or one of finalize's pieces (Arrow IPC)."""
        if path.endswith(".parquet"):
            if self._cached_reads or isinstance(self.files, LocalFiles):
                part = self.files.parquet(path)
            else:
                part = pq.ParquetFile(pa.BufferReader(self.files.read_bytes(path)))
            present = [c for c in columns if c in part.schema_arrow.names]
            read = part.read(columns=present, use_threads=False)
            if columns is ROWS_COLUMNS:
                return read.select(columns)
            # A part staged before a column existed (a job resumed across versions) reads it as nulls.
            return with_later_columns(read).select(columns)
        with pa.ipc.open_stream(pa.py_buffer(self.files.read_bytes(path))) as reader:
            return reader.read_all().select(columns)

    def write(self, path: str, table: pa.Table) -> None:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema, options=PIECE_OPTIONS) as writer:
            writer.write_table(table.combine_chunks())
        self.files.write_bytes(path, sink.getvalue().to_pybytes())

    def write_json(self, path: str, obj: Any) -> None:
        self.files.write_bytes(path, json.dumps(obj, ensure_ascii=False).encode())

    def read_json(self, path: str) -> Any | None:
        try:
            return json.loads(self.files.read_bytes(path))
        except FileNotFoundError:
            return None


def _batches(ctx: _Context, parts: Sequence[str], columns: list[str]) -> Iterator[pa.Table]:
    """The rows of `parts`, in order, a few parts at a time."""
    tables: list[pa.Table] = []
    rows = 0
    for part in parts:
        table = ctx.read(part, columns)
        tables.append(table)
        rows += table.num_rows
        if rows >= ROUTE_ROWS:
            yield pa.concat_tables(tables)
            tables, rows = [], 0
    if tables:
        yield pa.concat_tables(tables)


def _keys(ctx: _Context, path: str, kind: str) -> pa.Array:
    if path.endswith(".parquet"):
        return sort_keys(ctx.read(path, KEY_COLUMNS[kind]), kind)
    return ctx.read(path, ["key"]).column("key").combine_chunks()


# -- the tasks (plain functions of (context, item): runtime/hosting/executor.py runs them) -----------------------------------


class GroupCall(NamedTuple):
    """A key or map task's item: one group of consecutive staged parts of a kind, and the keys to route them by."""

    kind: str
    group: int
    parts: list[str]
    bounds: list[bytes]


class CutCall(NamedTuple):
    """A cut task's item: one bucket's keys (its key pieces, or the staged parts when there is one bucket)."""

    kind: str
    sources: list[str]
    offsets: list[int]  # the sorted positions in this bucket where a shard starts
    check_duplicates: bool


class ReduceCall(NamedTuple):
    """A reduce task's item: one shard of `count`, and the pieces (or staged parts) that hold its rows."""

    kind: str
    shard: int
    count: int
    sources: list[str]
    rows: Sequence[str] = ()  # a dataset job's table: the pieces (or staged parts) of its kept input rows


def _key_task(ctx: _Context, call: GroupCall) -> list[int]:
    """Plan, step 1: the sort keys of one group of parts, written per bucket; returns the rows of each bucket."""
    kind, group, parts, bounds = call
    boundaries = pa.array(bounds, pa.binary())
    buckets: dict[int, list[pa.Table]] = {}
    for table in _batches(ctx, parts, KEY_COLUMNS[kind]):
        keys = sort_keys(table, kind)
        for bucket, rows in split_by_shard(pa.table({"key": keys}), assign_shards(keys, boundaries)).items():
            buckets.setdefault(bucket, []).append(rows)
    counts = [0] * (len(bounds) + 1)
    for bucket, tables in buckets.items():
        keys_in_bucket = pa.concat_tables(tables)
        counts[bucket] = keys_in_bucket.num_rows
        ctx.write(ctx.key_piece(kind, bucket, group), keys_in_bucket)
    return counts


def _cut_task(ctx: _Context, call: CutCall) -> tuple[list[bytes], str | None]:
    """Plan, step 2: one bucket's keys, sorted; the keys at `offsets` (exact shard boundaries) and the first
    result id staged twice, if any. `sources`: its key pieces, or the staged parts when there is one bucket."""
    kind, sources, offsets, check_duplicates = call
    keys = pa.chunked_array([_keys(ctx, path, kind) for path in sources], pa.binary()).combine_chunks()
    ordered = keys.take(pc.sort_indices(keys))
    duplicate = first_duplicate(ordered) if check_duplicates else None
    found = [ordered[offset].as_py() for offset in offsets]
    return found, None if duplicate is None else duplicate.decode("utf-8", "replace")


class _Pieces:
    """A map task's rows per shard, written out as pieces when SPILL_FLUSH_BYTES are held and at the end."""

    def __init__(self, ctx: _Context, kind: str, group: int) -> None:
        self.ctx, self.kind, self.group = ctx, kind, group
        self.held: dict[int, list[pa.Table]] = {}
        self.held_bytes = 0
        self.written: dict[int, list[tuple[str, int]]] = {}

    def add(self, shard: int, rows: pa.Table) -> None:
        self.held.setdefault(shard, []).append(rows)
        self.held_bytes += rows.nbytes
        if self.held_bytes >= SPILL_FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        for shard, tables in sorted(self.held.items()):
            pieces = self.written.setdefault(shard, [])
            path = self.ctx.piece(self.kind, shard, self.group, len(pieces))
            table = pa.concat_tables(tables)
            self.ctx.write(path, table)
            pieces.append((path, table.num_rows))
        self.held.clear()
        self.held_bytes = 0


def _map_task(ctx: _Context, call: GroupCall) -> dict[str, list[tuple[str, int]]]:
    """Route the rows of one group of parts to their shards, as pieces; returns (and records) {shard: pieces}."""
    kind, group, parts, bounds = call
    boundaries = pa.array(bounds, pa.binary())
    pieces = _Pieces(ctx, kind, group)
    for table in _batches(ctx, parts, _columns(kind)):
        for shard, rows in split_by_shard(table, assign_shards(sort_keys(table, kind), boundaries)).items():
            pieces.add(shard, rows)
    pieces.flush()
    written = {str(shard): paths for shard, paths in pieces.written.items()}
    ctx.write_json(ctx.mapped_record(kind, group), written)  # after the pieces: they are complete
    return written


def _reduce_task(ctx: _Context, call: ReduceCall) -> dict[str, Any]:
    """Write one shard: its pieces (or the staged parts), sorted, through the format's encoder; then record its
    ShardInfo. Memory: one shard."""
    kind, shard, count, sources, rows = call
    tables = [ctx.read(path, READ_COLUMNS) for path in sources]
    table = pa.concat_tables(tables) if tables else STAGED_SCHEMA.empty_table().select(READ_COLUMNS)
    table = sort_table(table, kind)
    if kind == "results":
        # Equal ids have equal keys, so they always meet in one shard: a check per shard covers the output.
        duplicate = first_duplicate(table.column("custom_id"))
        if duplicate is not None:
            raise AccountingError(f"custom_id {duplicate!r} staged twice as a result")
    if kind == "table":
        info = _write_table_shard(ctx, table, rows, shard, count)
        results = table.filter(pc.is_null(table.column("error_code")))
    else:
        encoder, extension = shard_encoder(ctx.format)
        info = write_shard(table, shard_name(kind, shard, count, extension), ctx.target().open_write, encoder)
        results = table
    record: dict[str, Any] = {
        "shard": info.as_manifest(),
        "tokens": {
            "prompt": int(pc.sum(table.column("prompt_tokens")).as_py() or 0),
            "completion": int(pc.sum(table.column("completion_tokens")).as_py() or 0),
        },
    }
    from pipeline.observe.usage import rows_by_model, structured_of, usage_of

    if kind in ("results", "table"):
        record["usage"] = usage_of(results)
        record["structured"] = structured_of(results)
    if kind in ("errors", "table"):
        codes = pc.value_counts(table.column("error_code").drop_null()).to_pylist() if table.num_rows else []
        record["error_codes"] = {c["values"]: c["counts"] for c in codes}
    record["models"] = rows_by_model(table)
    ctx.write_json(ctx.done_record(kind, shard), record)  # after the shard is complete (closed, uploaded)
    return record


def _write_table_shard(
    ctx: _Context, answers: pa.Table, rows: list[str], shard: int, count: int
) -> ShardInfo:
    """A dataset job's shard: its answers (sorted) joined row for row with the kept input rows routed to it. Every
    input row was staged once at ingest and every one has its answer or error record, so the two sides hold the
    same keys; anything else is an accounting error, and nothing is committed."""
    from pipeline.datasets.output import answered_table, table_encoder

    kept_parts = [ctx.read(path, ROWS_COLUMNS) for path in rows]
    kept = (
        pa.concat_tables(kept_parts, promote_options="permissive")
        if kept_parts
        else pa.table({"custom_id": pa.array([], pa.string()), "row": pa.array([], pa.string())})
    )
    kept = sort_table(kept, "rows") if kept_parts else kept
    if kept.num_rows != answers.num_rows or (
        kept_parts and not sort_keys(kept, "rows").equals(sort_keys(answers, "table"))
    ):
        raise AccountingError(
            f"table shard {shard}: {answers.num_rows} answers for {kept.num_rows} input rows, or rows that do not "
            "match their answers; output not committed"
        )
    assert ctx.table is not None
    joined = answered_table(kept, answers.column("record").to_pylist(), ctx.table)
    encoder, extension = table_encoder(ctx.format)
    name = shard_name("results", shard, count, extension)
    return write_shard(joined, name, ctx.target().open_write, encoder, ids=answers.column("custom_id"))


# -- where the tasks run ---------------------------------------------------------------------------------------------


def _this_host() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _executor(local_paths: bool, reserve_cpus: bool) -> TaskExecutor:
    """Ray tasks when Ray is up (pinned to the driver's node when `local_paths` must be, else spread), else calls
    in this process. Tasks take one CPU each, or none with `reserve_cpus` off (warm engines hold the CPUs).
    A failed task is raised once every other task has settled (keep_going): the shards that finish are recorded,
    so a resume has less to redo."""
    placement = ray_placement(local_paths)
    if placement is not None and placement.node is not None and placement.cpus < 1:
        # A head that offers no CPUs to tasks (KubeRay's usual `num-cpus: 0`) is meant to run none.
        log.warning(
            "finalize runs in the driver: its files are on this node's disk, which has no CPUs for Ray "
            "tasks; an s3:// OUTPUT lets the cluster do it"
        )
        placement = None
    return TaskExecutor(placement, reserve_cpus, keep_going=True)


def _by_node_label(tasks_by_node: Counter[str]) -> dict[str, int]:
    """Tasks per node as the manifest names it: a node id's first 8 characters, or "driver" (in this process)."""
    labelled: Counter[str] = Counter()
    for node, tasks in tasks_by_node.items():
        labelled["driver" if node == IN_PROCESS else node[:8]] += tasks
    return dict(sorted(labelled.items()))


# -- the plan ----------------------------------------------------------------------------------------------------------


def _part_rows(staging: StagingArea, parts: list[str]) -> list[int]:
    return [staging.files.parquet(p).metadata.num_rows for p in parts]


def _sample(ctx: _Context, kind: str, parts: list[str], buckets: int) -> pa.Array:
    """Sort keys from a bounded number of parts spread over all of them (parts are sorted, so keys at even steps
    through a part are a fair sample of it). None needed for a single bucket."""
    if buckets <= 1 or not parts:
        return pa.array([], pa.binary())
    chosen = sorted({int(i) for i in np.linspace(0, len(parts) - 1, min(len(parts), SAMPLE_PARTS)).round()})
    per_part = min(MAX_SAMPLE_PER_PART, -(-SAMPLE_KEYS_PER_BUCKET * buckets // len(chosen)))
    keys = [evenly_spaced(_keys(ctx, parts[i], kind), per_part) for i in chosen]
    return pa.chunked_array(keys, pa.binary()).combine_chunks()


def _make_plan(
    ctx: _Context,
    tasks: TaskExecutor,
    tasks_by_node: Counter[str],
    parts: dict[str, list[str]],
    rows: dict[str, list[int]],
    rows_per_shard: int,
) -> dict[str, Any]:
    """Exact shard boundaries for both kinds (see the module docstring). Raises AccountingError on a result id
    staged twice — before anything in OUTPUT is touched. A dataset job's kept rows take its table's boundaries."""
    plan: dict[str, Any] = {"version": PLAN_VERSION, "rows_per_shard": rows_per_shard, "format": ctx.format}
    kinds = [kind for kind in parts if kind != "rows"]
    key_calls, bucket_splitters = [], {}
    for kind in kinds:
        total = sum(rows[kind])
        groups = [
            [parts[kind][i] for i in g]
            for g in group_parts(rows[kind], max(MAP_TASK_ROWS, -(-total // MAX_MAP_TASKS)))
        ]
        count = shard_count(total, rows_per_shard)
        plan[kind] = {"rows": total, "shards": count, "groups": groups, "boundaries": []}
        bounds = splitters(_sample(ctx, kind, parts[kind], count), count)
        bucket_splitters[kind] = bounds.to_pylist()
        if len(bounds):
            key_calls += [GroupCall(kind, g, group, bucket_splitters[kind]) for g, group in enumerate(groups)]
    counts = iter(tasks.map(_key_task, ctx, key_calls, tasks_by_node=tasks_by_node))

    cut_calls: list[CutCall] = []
    for kind in kinds:
        entry = plan[kind]
        if bucket_splitters[kind]:
            per_group = [next(counts) for _ in entry["groups"]]
            bucket_rows = [sum(c[b] for c in per_group) for b in range(len(bucket_splitters[kind]) + 1)]
            sources = [
                [ctx.key_piece(kind, b, g) for g, c in enumerate(per_group) if c[b]]
                for b in range(len(bucket_rows))
            ]
        else:
            bucket_rows, sources = [entry["rows"]], [parts[kind]]
        cuts = locate_cuts(bucket_rows, cut_ranks(entry["rows"], rows_per_shard))
        check = kind == "results"  # error records are keyed by source position, which the input makes unique
        for bucket, n in enumerate(bucket_rows):
            if n and (check or bucket in cuts):
                cut_calls.append(CutCall(kind, sources[bucket], cuts.get(bucket, []), check))
    boundaries: dict[str, list[bytes]] = {kind: [] for kind in kinds}
    cuts_found = tasks.map(_cut_task, ctx, cut_calls, tasks_by_node=tasks_by_node)
    for (kind, *_), (keys, duplicate) in zip(cut_calls, cuts_found, strict=True):
        if duplicate is not None:
            raise AccountingError(f"custom_id {duplicate!r} staged twice as a result")
        boundaries[kind] += keys  # buckets in order, offsets in order: the cuts in order
    for kind in kinds:
        plan[kind]["boundaries"] = [key.hex() for key in boundaries[kind]]
    if "rows" in parts:
        total = sum(rows["rows"])
        groups = [
            [parts["rows"][i] for i in g]
            for g in group_parts(rows["rows"], max(MAP_TASK_ROWS, -(-total // MAX_MAP_TASKS)))
        ]
        plan["rows"] = {**plan["table"], "rows": total, "groups": groups}
    return plan


def _load_plan(ctx: _Context, parts: dict[str, list[str]], rows_per_shard: int) -> dict[str, Any] | None:
    """The plan of an earlier attempt, when it still fits what is staged; else None, and its files are gone."""
    plan = ctx.read_json(ctx.plan_path())
    if plan is None:
        return None
    fits = (
        plan.get("version") == PLAN_VERSION
        and plan.get("rows_per_shard") == rows_per_shard
        and plan.get("format") == ctx.format
        and all(
            kind in plan and [p for g in plan[kind]["groups"] for p in g] == parts[kind] for kind in parts
        )
    )
    if fits:
        return plan
    log.warning("staging changed since finalize was planned; planning again")
    ctx.files.delete([ctx.plan_path()])  # first: without it nothing else under finalize/ counts
    ctx.files.delete_tree(ctx.root)
    return None


# -- finalize --------------------------------------------------------------------------------------------------------


def write_outputs(
    output: Path | str | OutputTarget,
    staging: StagingArea,
    rows_per_shard: int,
    expected_rows: int,
    format: str = "jsonl",
    reserve_cpus: bool = True,
    table: TableOutput | None = None,
) -> FinalizeOutputs:
    """Write the shards; returns counts, shard descriptions and the nodes that ran finalize, for the manifest.
    `reserve_cpus=False`: engines still hold the cluster's CPUs (warm engines), so tasks take none.
    `table`: a dataset job's (datasets/output.TableOutput): one table of every input row with its answer, no error
    shards."""
    target = _as_target(output)
    staged = {kind: staging.parts(kind) for kind in KINDS}
    n_results, n_errors = (sum(_part_rows(staging, staged[kind])) for kind in KINDS)
    if n_results + n_errors != expected_rows:
        raise AccountingError(
            f"staging holds {n_results} results + {n_errors} errors = {n_results + n_errors} rows, "
            f"but the input has {expected_rows}; output not committed"
        )
    if table is None:
        parts = staged
    else:
        parts = {"table": staged["results"] + staged["errors"], "rows": staging.parts("rows")}
    rows = {kind: _part_rows(staging, parts[kind]) for kind in parts}
    if table is not None and sum(rows["rows"]) != expected_rows:
        raise AccountingError(
            f"staging holds {sum(rows['rows'])} input rows of a table of {expected_rows}; output not committed"
        )
    kinds = [kind for kind in parts if kind != "rows"]  # the kinds written as shards
    shard_encoder(format)  # an unknown format fails here, before anything is written
    tasks = _executor(isinstance(staging.files, LocalFiles) or target.is_local, reserve_cpus)
    tasks_by_node: Counter[str] = Counter()  # Ray node id (or IN_PROCESS) → finalize tasks it ran
    ctx = _Context(
        staging.files,
        staging.finalize_dir,
        target.location,
        target.storage,
        format,
        tasks.placement.driver_address if tasks.placement is not None else None,
        table=table,
        _target=target,
    )

    started = time.monotonic()
    plan = _load_plan(ctx, parts, rows_per_shard)
    resumed = plan is not None
    if plan is None:
        plan = _make_plan(ctx, tasks, tasks_by_node, parts, rows, rows_per_shard)
        target.remove_previous_outputs()
        ctx.write_json(ctx.plan_path(), plan)  # after the removal: its presence means OUTPUT is ours to write
    counts = {kind: plan[kind]["shards"] for kind in parts}
    done: dict[str, dict[int, dict[str, Any]]] = {kind: {} for kind in parts}
    if resumed:
        for kind in kinds:
            for shard in range(counts[kind]):
                if (record := ctx.read_json(ctx.done_record(kind, shard))) is not None:
                    done[kind][shard] = record
        log.info("finalize resumed", shards_done={kind: len(done[kind]) for kind in kinds})
    if "rows" in parts:
        done["rows"] = done["table"]  # the kept rows are written with the table's shards

    # Map: the groups of every kind with more than one shard left to write, unless mapped by an earlier attempt.
    pieces: dict[str, list[dict[str, list]]] = {kind: [] for kind in parts}
    map_calls: list[GroupCall] = []
    for kind in parts:
        if counts[kind] == 1 or len(done[kind]) == counts[kind]:
            continue
        bounds = [bytes.fromhex(key) for key in plan[kind]["boundaries"]]
        for g, group in enumerate(plan[kind]["groups"]):
            record = ctx.read_json(ctx.mapped_record(kind, g)) if resumed else None
            pieces[kind].append(record)
            if record is None:
                map_calls.append(GroupCall(kind, g, group, bounds))
    planned = time.monotonic()
    mapped = iter(tasks.map(_map_task, ctx, map_calls, tasks_by_node=tasks_by_node))
    for kind in parts:
        pieces[kind] = [record if record is not None else next(mapped) for record in pieces[kind]]

    def shard_sources(kind: str, shard: int) -> list[str]:
        if counts[kind] == 1:
            return parts[kind]
        return [path for group in pieces[kind] for path, _ in group.get(str(shard), [])]

    # Reduce: every shard not yet recorded.
    routed = time.monotonic()
    reduce_calls: list[ReduceCall] = []
    for kind in kinds:
        for shard in range(counts[kind]):
            if shard in done[kind]:
                continue
            kept = shard_sources("rows", shard) if kind == "table" else []
            reduce_calls.append(ReduceCall(kind, shard, counts[kind], shard_sources(kind, shard), kept))
    written_shards = tasks.map(_reduce_task, ctx, reduce_calls, tasks_by_node=tasks_by_node)
    for call, record in zip(reduce_calls, written_shards, strict=True):
        done[call.kind][call.shard] = record

    shards = {kind: [done[kind][s]["shard"] for s in range(counts[kind])] for kind in kinds}
    expected = {"table": expected_rows} if table is not None else {"results": n_results, "errors": n_errors}
    for kind, total in expected.items():
        written = sum(s["rows"] for s in shards[kind])
        if written != total:
            raise AccountingError(f"{kind}: {total} rows staged, {written} written; output not committed")
    if table is not None:  # the table's shards are the output's result shards; its errors are in it
        shards = {"results": shards["table"], "errors": []}
    log.info(
        "finalize written",
        plan_s=round(planned - started, 2),
        map_s=round(routed - planned, 2),
        reduce_s=round(time.monotonic() - routed, 2),
        tasks=sum(tasks_by_node.values()),
        ran=tasks.where,
        shards_written=len(reduce_calls),
    )
    by_code: Counter[str] = Counter()
    for kind in kinds:
        for record in done[kind].values():
            by_code.update(record.get("error_codes", {}))
    from pipeline.observe.usage import merge, merge_rows_by_model

    # Shards recorded by a version that did not histogram usage have none: the percentiles then cover the others.
    answered = [record for kind in kinds for record in done[kind].values() if "usage" in record]
    usage = merge([record["usage"] for record in answered])
    by_model = merge_rows_by_model(
        [record.get("models", {}) for kind in kinds for record in done[kind].values()]
    )
    structured = {"requested": 0, "parsed_json": 0}
    for record in answered:
        for key in structured:
            structured[key] += record.get("structured", {}).get(key, 0)
    tokens = {"prompt": 0, "completion": 0}
    for kind in kinds:
        for record in done[kind].values():
            for key in tokens:
                tokens[key] += record.get("tokens", {}).get(key, 0)
    return FinalizeOutputs(
        counts=Counts(
            total=expected_rows,
            succeeded=n_results,
            failed=n_errors,
            by_error_code=dict(sorted(by_code.items())),
            # Results of requests that asked for JSON output, and how many of those parsed (observe/usage.py).
            structured=StructuredCounts(**structured),
        ),
        shards=Shards.model_validate(shards),
        tokens=Tokens(**tokens),
        usage_histograms=usage,
        rows_by_model=by_model,
        tasks_by_node=_by_node_label(tasks_by_node),
    )


def commit(
    output: Path | str | OutputTarget, staging: StagingArea, manifest: Manifest | dict[str, Any]
) -> None:
    """The manifest is written last and atomically: its presence means every shard is complete. Then `_staging/`
    goes (wherever it lives: OUTPUT, the bucket, or this machine's disk for an http(s):// output).

    A job's Manifest is written as its `model_dump(mode="json")`; a plain dict (finalize used on its own, without
    a job) as it is."""
    target = _as_target(output)
    if isinstance(manifest, Manifest):
        manifest = manifest.model_dump(mode="json")
    if target.is_local:
        directory = Path(target.location.path)
        # Durable as well: the shards' directory entries reach the disk before the manifest that vouches for them
        # (each shard's bytes did when it was closed, io/writers.py), then the manifest's own entry.
        fsync_path(directory)
        atomic_write_json(directory / MANIFEST_NAME, manifest)
        fsync_path(directory)
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
