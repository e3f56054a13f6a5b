"""Duplicate custom_ids across the whole input, without one set of every id on one machine: id buckets.

The rule (the same as `LineValidator` applies with its set): a line that names a usable custom_id claims it, valid
or not; the first claim by (file, line) owns the id, and every later line that claims it is a `duplicate_custom_id`
error record instead of whatever it would have been.

1. Each ingest task (runtime/ingest/tasks.py) writes every claim it read to bucket crc32(custom_id) % N:
   `_staging/ids/bucket-k/piece-p.parquet` — the id, where it is (file, line, piece), what became of the line (a
   request in the work list, or the code of its error record) and what measuring learned of it.
2. One task per bucket (`find_duplicates`) reads its bucket alone — every claim of an id is in the same bucket —
   orders each duplicated id's claims by (file, line), writes a duplicate error record for every claim but the
   first (`_staging/errors/validate-dup-k-*.parquet`) and lists the losers of each piece
   (`_staging/ids/losers/piece-p-bucket-k.parquet`). It also sums the lengths of the requests that stay in the work
   list: fitting needs only that aggregate, and only here is it known which occurrence stays.
3. One task per piece with losers (`drop_losers`) removes their first outcome from the parts that piece staged: a
   request leaves the work list, an error record leaves the error parts. A part is rewritten under a new name and
   the old one deleted: staged parts are otherwise immutable, and a node's read cache of an S3 part must never
   serve its old content (listings always ask the bucket, so a new name is always read afresh).

Steps 2 and 3 are idempotent (fixed names; a part already rewritten is gone), so a retried task changes nothing.

When engines take requests while ingest still runs (streaming), the work list is theirs before step 2 knows which
requests lost their id: step 3 then leaves request parts alone, a losing request may run, and once the engines are
done (or when a resumed job starts) `settle_losers` in runtime/ingest/tasks.py drops the losers from the work list and
their rows from what the engines staged (`drop_loser_results`), by (file, line) — a result's custom_id is its
winner's too.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.fit_record import Lengths
from pipeline.io.staging import INGEST_PREFIX, StagedRow, StagingArea
from pipeline.protocol import ErrorCode, dumps
from pipeline.stages.validate import duplicate_line

ID_SCHEMA = pa.schema(
    [
        ("custom_id", pa.string()),
        ("file", pa.int32()),
        ("line", pa.int64()),
        ("piece", pa.int32()),
        ("code", pa.string()),  # null: the line is a request in the work list; else its error record's code
        ("keyed", pa.bool_()),  # a valid request with a prefix key (report.keyed counts them)
        # What measuring learned of a request (zeros when nothing was measured):
        ("untokenizable", pa.bool_()),
        ("sequences", pa.int32()),
        ("prompt_sum", pa.int64()),
        ("prompt_max", pa.int64()),
        ("output", pa.int64()),
        ("assumed", pa.bool_()),
        ("capped", pa.bool_()),
    ]
)
LOSER_SCHEMA = pa.schema([("line", pa.int64()), ("code", pa.string()), ("source", pa.string())])
REQUEST = "request"  # how a loser that was a request is counted in `replaced`


def bucket_of(custom_id: str, buckets: int) -> int:
    """The bucket of an id: the same in every process (Python's own str hash is salted per process)."""
    return zlib.crc32(custom_id.encode("utf-8", "surrogatepass")) % buckets


def bucket_dir(staging: StagingArea, bucket: int) -> str:
    return f"{staging.ids_dir}/bucket-{bucket:04d}"


def losers_dir(staging: StagingArea) -> str:
    """Where step 2 lists each piece's losers: `piece-p-bucket-k.parquet`, one flat directory (listed whole)."""
    return f"{staging.ids_dir}/losers"


def losers_of(staging: StagingArea, piece: int) -> list[str]:
    prefix = f"piece-{piece:06d}-"
    return [
        p for p in staging.files.list_parts(losers_dir(staging)) if p.rsplit("/", 1)[-1].startswith(prefix)
    ]


class IdRows:
    """The claims one ingest task read, gathered per bucket in Arrow (compact), written once at its end."""

    NOT_MEASURED = (False, 0, 0, 0, 0, False, False)

    def __init__(self, piece: int, buckets: int) -> None:
        self.piece = piece
        self.buckets = buckets
        self._rows: list[tuple] = []
        self._batches: list[pa.RecordBatch] = []

    def add(
        self,
        custom_id: str,
        file: int,
        line: int,
        code: str | None,
        keyed: bool = False,
        measured: tuple[bool, int, int, int, int, bool, bool] = NOT_MEASURED,
    ) -> None:
        """`measured`: (untokenizable, sequences, prompt_sum, prompt_max, output, assumed, capped)."""
        self._rows.append((custom_id, file, line, self.piece, code, keyed, *measured))
        if len(self._rows) >= 65536:
            self._seal()

    def _seal(self) -> None:
        if self._rows:
            columns = list(zip(*self._rows, strict=True))
            arrays = [pa.array(values, f.type) for values, f in zip(columns, ID_SCHEMA, strict=True)]
            buckets = self.buckets
            arrays.append(pa.array([bucket_of(custom_id, buckets) for custom_id in columns[0]], pa.int32()))
            self._batches.append(pa.RecordBatch.from_arrays(arrays, names=[*ID_SCHEMA.names, "bucket"]))
            self._rows = []

    def write(self, staging: StagingArea) -> None:
        """One part per bucket this piece has ids in (fixed names: a task run again replaces its parts)."""
        self._seal()
        if not self._batches:
            return
        table = pa.Table.from_batches(self._batches).sort_by("bucket")
        buckets = table.column("bucket").to_numpy()
        start = 0
        while start < len(buckets):
            bucket = int(buckets[start])
            end = int(buckets.searchsorted(bucket, side="right"))
            part = table.slice(start, end - start).drop_columns(["bucket"])
            directory = bucket_dir(staging, bucket)
            staging.files.makedirs(directory)
            staging.files.write_parquet(part, f"{directory}/piece-{self.piece:06d}.parquet")
            start = end


@dataclass
class BucketOutcome:
    """What one bucket task found: small, whatever the size of the bucket."""

    bucket: int
    lengths: Lengths = field(default_factory=Lengths)  # of the requests that stay in the work list
    duplicates: int = 0  # claims that lost to an earlier one: now duplicate_custom_id error records
    replaced: Counter = field(default_factory=Counter)  # what those lines had been: REQUEST or an error code
    replaced_keyed: int = 0  # of them, requests with a prefix key
    pieces: list[int] = field(default_factory=list)  # pieces that staged a loser
    seconds: float = 0.0


def find_duplicates(
    staging: StagingArea, bucket: int, sources: list[str], job_id: str | None, part_rows: int
) -> BucketOutcome:
    """Step 2 for one bucket (see the module's docstring). `sources`: the input files' names, by index."""
    started = time.monotonic()
    outcome = BucketOutcome(bucket)
    parts = staging.files.list_parts(bucket_dir(staging, bucket))
    if not parts:
        return outcome
    table = pa.concat_tables(staging.read_part(part) for part in parts)
    counts = table.group_by("custom_id").aggregate([("custom_id", "count")])
    repeated = counts.filter(pc.greater(counts.column("custom_id_count"), 1)).column("custom_id")
    winners = table
    if len(repeated):
        table = table.append_column("row", pa.array(range(table.num_rows), pa.int64()))
        claims = table.filter(pc.is_in(table.column("custom_id"), value_set=repeated)).sort_by(
            [("custom_id", "ascending"), ("file", "ascending"), ("line", "ascending")]
        )
        ids = claims.column("custom_id").to_pylist()
        later = pa.array([i > 0 and ids[i] == ids[i - 1] for i in range(len(ids))])
        losers = claims.filter(later)
        winners = table.filter(pc.invert(pc.is_in(table.column("row"), value_set=losers.column("row"))))
        _record_losers(staging, bucket, losers, sources, job_id, part_rows, outcome)
    outcome.lengths = lengths_of(winners)
    outcome.seconds = time.monotonic() - started
    return outcome


def _record_losers(
    staging: StagingArea,
    bucket: int,
    losers: pa.Table,
    sources: list[str],
    job_id: str | None,
    part_rows: int,
    outcome: BucketOutcome,
) -> None:
    outcome.duplicates = losers.num_rows
    codes = losers.column("code").to_pylist()
    outcome.replaced = Counter(code or REQUEST for code in codes)
    outcome.replaced_keyed = int(pc.sum(losers.column("keyed")).as_py() or 0)
    rows = []
    for custom_id, file, line in zip(
        losers.column("custom_id").to_pylist(),
        losers.column("file").to_pylist(),
        losers.column("line").to_pylist(),
        strict=True,
    ):
        source = sources[file]
        record = duplicate_line(custom_id, line, source, job_id).record
        rows.append(
            StagedRow(custom_id, line, source, ErrorCode.DUPLICATE_CUSTOM_ID.value, 0, 0, "", dumps(record))
        )
    for seq, start in enumerate(range(0, len(rows), part_rows)):
        name = f"{INGEST_PREFIX}-dup-{bucket:04d}-{seq:04d}.parquet"
        staging.write_rows("errors", rows[start : start + part_rows], name=name)
    losers = losers.append_column(
        "source", pa.array([sources[file] for file in losers.column("file").to_pylist()], pa.string())
    )
    pieces = losers.column("piece")
    for piece in sorted(pc.unique(pieces).to_pylist()):
        mine = losers.filter(pc.equal(pieces, piece)).select(LOSER_SCHEMA.names)
        directory = losers_dir(staging)
        staging.files.makedirs(directory)
        staging.files.write_parquet(mine, f"{directory}/piece-{piece:06d}-bucket-{bucket:04d}.parquet")
        outcome.pieces.append(piece)


def lengths_of(claims: pa.Table) -> Lengths:
    """fit's Lengths of the requests among `claims` (rows of ID_SCHEMA), as `Lengths.add` in input order gives."""
    lengths = Lengths()
    code = claims.column("code")
    lengths.too_long = int(pc.sum(pc.equal(code, ErrorCode.CONTEXT_LENGTH_EXCEEDED.value)).as_py() or 0)
    requests = claims.filter(pc.is_null(code))
    untokenizable = requests.column("untokenizable")
    lengths.untokenizable = int(pc.sum(untokenizable).as_py() or 0)
    measured = requests.filter(pc.invert(untokenizable))

    def total(column: str | pa.ChunkedArray) -> int:
        values = measured.column(column) if isinstance(column, str) else column
        return int(pc.sum(values).as_py() or 0)

    lengths.requests = measured.num_rows
    lengths.sequences = total("sequences")
    lengths.prompt_sum = total("prompt_sum")
    outputs = pc.multiply(measured.column("sequences").cast(pa.int64()), measured.column("output"))
    lengths.need_sum = lengths.prompt_sum + total(outputs)
    lengths.assumed_output = total("assumed")
    lengths.output_capped = total("capped")
    started = measured.filter(pc.greater(measured.column("sequences"), 0))
    if started.num_rows:
        lengths.longest_prompt = int(pc.max(started.column("prompt_max")).as_py())
        need = pc.add(started.column("prompt_max"), started.column("output"))
        top = int(pc.max(need).as_py())
        if top > 0:
            first = started.filter(pc.equal(need, top)).sort_by(
                [("file", "ascending"), ("line", "ascending")]
            )
            row = first.slice(0, 1).to_pylist()[0]
            lengths.longest_need, lengths.longest_id = top, row["custom_id"]
            lengths.longest_prompt_of_longest = row["prompt_max"]
            lengths.longest_at = (row["file"], row["line"])
    return lengths


def drop_losers(staging: StagingArea, piece: int, parts: list[str]) -> int:
    """Step 3 for one piece: its parts without the lines that lost their custom_id. Returns the rows removed."""
    found = losers_of(staging, piece)
    if not found:
        return 0
    lines = pa.concat_tables(staging.read_part(p, ["line"]) for p in found).column("line").combine_chunks()
    removed = 0
    for path in parts:
        try:
            table = staging.files.parquet(path).read()
        except FileNotFoundError:  # rewritten by an earlier attempt of this task
            continue
        keep = pc.invert(pc.is_in(table.column("line"), value_set=lines))
        left = table.filter(keep)
        if left.num_rows == table.num_rows:
            continue
        removed += table.num_rows - left.num_rows
        if left.num_rows:
            staging.files.write_parquet(left, rewritten_name(path))
        staging.files.delete([path])
    return removed


def rewritten_name(path: str) -> str:
    """`part-000003-0001.parquet` → `part-000003-0001d.parquet`: sorts where the original did."""
    return path.removesuffix(".parquet") + "d.parquet"


def request_losers(staging: StagingArea) -> pa.Table:
    """(source, line) of every request that lost its custom_id, recorded by step 2 and not yet settled."""
    found = staging.files.list_parts(losers_dir(staging))
    if not found:
        return pa.table({"source": pa.array([], pa.string()), "line": pa.array([], pa.int64())})
    table = pa.concat_tables(staging.read_part(p, ["line", "code", "source"]) for p in found)
    return table.filter(pc.is_null(table.column("code"))).select(["source", "line"])


def drop_loser_results(staging: StagingArea, parts: list[str], losers: pa.Table) -> int:
    """Engine-staged parts without the rows of requests that lost their custom_id (`losers`: source, line): such a
    row carries its winner's custom_id, so only its place in the input tells it apart. Returns the rows removed."""
    by_source: dict[str, pa.Array] = {}
    for source in pc.unique(losers.column("source")).to_pylist():
        lines = losers.filter(pc.equal(losers.column("source"), source)).column("line")
        by_source[source] = lines.combine_chunks()
    removed = 0
    for path in parts:
        try:
            table = staging.read_part(path)
        except FileNotFoundError:  # rewritten by an earlier attempt of this task
            continue
        drop = pa.array([False] * table.num_rows)
        for source, lines in by_source.items():
            here = pc.and_(pc.equal(table.column("source"), source), pc.is_in(table.column("line"), lines))
            drop = pc.or_(drop, pc.fill_null(here, False))
        dropped = int(pc.sum(drop).as_py() or 0)
        if not dropped:
            continue
        removed += dropped
        left = table.filter(pc.invert(drop))
        if left.num_rows:
            staging.files.write_parquet(left, rewritten_name(path))
        staging.files.delete([path])
    return removed
