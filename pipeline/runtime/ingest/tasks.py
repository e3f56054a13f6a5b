"""Read → validate → measure → stage, on the cluster: the input becomes the engines' work list and the first error
records, and only an aggregate comes back to the driver.

The input is cut into pieces (`InputSource.plan_reads`: whole files, byte ranges of large JSONL files, row groups of
Parquet files; an http(s) input is one piece) and four steps run as parallel tasks, each a plain function of
(the job, one item), run by runtime/hosting/executor.py: as Ray tasks when Ray is initialized, in this process otherwise
(unit tests; no Ray needed):

1. scan: byte ranges are read once — newline counts (a JSONL range does not know how many lines precede it, so its
   line numbers start where the counts of the ranges ahead of it end; counting is a bytes.count, far cheaper than
   the parse it lets start), and for a local input the sha256 of each range (the fingerprint `resume` compares).
   Ranges are read in parallel, so a large file is cut into enough of them for every worker to get several: the
   last ones to finish are short (`range_bytes`, unless given: the input / 8 per worker, 8 to 64 MiB).
2. read (`read_piece`): each piece's rows are validated (`LineValidator.check`, without a duplicate set), keyed for
   prefix routing and, when the job is fitted, measured with the counter fitting uses (a tokenizer loads once per
   worker process, engines/fitting.prompt_counter); a request that can never fit the model becomes a context_length_exceeded
   error record here. The piece stages its requests (`_staging/requests/`) and error records (`_staging/errors/`),
   part names fixed by the piece (a task run again replaces its parts), and writes its custom_id claims to id
   buckets.
3. dedup, per bucket (runtime/ingest/dedup.py): duplicates are found, recorded, and the lengths of the requests that stay
   are summed (fit's Lengths, mergeable).
4. per piece that read a losing duplicate: what it had staged for that line (a request, or another error record)
   is removed from its parts.

The driver merges small per-task statistics. Its CPU and memory grow with the number of pieces, never with rows.
Placement: a local input, or a local staging area (local OUTPUT), is on the driver's disk (`on_drivers_disk`), so on
a cluster that spans several hosts the tasks are pinned to the driver's node; otherwise (an s3:// input staged to
s3://, or every node on the driver's host) they go wherever Ray finds room.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import InputLimits, StorageConfig
from pipeline.datasets.kept import KeptRows, kept_struct
from pipeline.datasets.render import RowRenderer
from pipeline.datasets.spec import DatasetConfig
from pipeline.engines.fitting import tokenizers_loaded
from pipeline.fit_record import Lengths
from pipeline.io.fingerprint import HASH_RANGE_BYTES
from pipeline.io.pieces import RANGE_BYTES, ByteRange, InputPiece, with_line_counts
from pipeline.io.readers import InputSource
from pipeline.io.rows import BadRow, ReadStats
from pipeline.io.staging import INGEST_PREFIX, REQUEST_SCHEMA, LocalFiles, StagedRow, StagingArea
from pipeline.json_codec import dumps_body
from pipeline.max_tokens import requested_max_tokens
from pipeline.protocol import ErrorCode, dumps, failed_request_record
from pipeline.runtime.hosting.executor import TaskExecutor, ray_placement
from pipeline.runtime.ingest.dedup import (
    REQUEST,
    BucketOutcome,
    IdRows,
    bucket_dir,
    drop_loser_results,
    drop_losers,
    find_duplicates,
    losers_dir,
    request_losers,
)
from pipeline.runtime.ingest.measure import MeasureSpec, context_problem
from pipeline.runtime.ingest.sample import (
    SAMPLE_PIECES,
    SAMPLE_RANGE_BYTES,
    Sample,
    measure_sample,
    sample_pieces,
)
from pipeline.stages.intake import InputCounts, as_source, bad_row_check
from pipeline.stages.prefix_key import routing_key
from pipeline.stages.validate import InvalidLine, LineValidator, ValidRequest

UNTOKENIZABLE = (True, 0, 0, 0, 0, False, False)  # an id row's measurement of a request the template rejected
RAMP_BYTES = (
    1 << 20
)  # a streamed job's first byte ranges: read in a fraction of a second, then each size doubles
MIN_RANGE_BYTES = 8 << 20  # byte ranges below this cost more in task overhead than they gain in balance
HELD = "held"  # marks the request parts of requests the early fit cannot serve
MEASURE_BATCH = 1024  # requests counted per call: a tokenizer works in bulk
BUCKET_BYTES = 1 << 30  # input bytes per id bucket: a few million ids, what one dedup task holds at once
MAX_BUCKETS = 64
SETTLE_PARTS_PER_TASK = 256  # engine-staged parts one task checks for rows of losing requests


@dataclass
class IngestReport(InputCounts):
    keyed: int = 0  # valid requests with a prefix key (a shared leading prompt worth routing by)
    lengths: Lengths | None = None  # what measuring learned, when the job is fitted
    range_bytes: int = RANGE_BYTES  # the size of the byte ranges large JSONL files were read in
    # Where the work ran: per step, Ray node id → tasks ("local": in this process), and the step's seconds.
    placement: dict[str, dict[str, int]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    task_cpu_s: float = 0.0  # CPU seconds the read tasks spent, wherever they ran
    tokenizer_loads: int = 0
    held: int = 0  # requests longer than the early fit serves: staged apart (HELD), run once the whole input is fitted

    def nodes(self) -> list[str]:
        return sorted({node for step in self.placement.values() for node in step})


# --- one row --------------------------------------------------------------------------------------------------------


def invalid_to_staged(item: InvalidLine) -> StagedRow:
    return StagedRow(
        custom_id=item.record["custom_id"],
        line=item.line,
        source=item.source,
        error_code=item.code,
        prompt_tokens=0,
        completion_tokens=0,
        pool="",
        record=dumps(item.record),
    )


# --- the job every task shares --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IngestJob:
    """What every ingest task needs (shipped to the workers once, through the object store)."""

    source: InputSource
    staging: StagingArea
    served: str | Mapping[str, str | None]  # the job's model name, or every served model and its task
    job_id: str | None
    limits: InputLimits
    measure: MeasureSpec | None
    buckets: int
    part_rows: int
    adapters: frozenset[str] = frozenset()  # LoRA adapter names: their rows are routed by adapter
    # Early fit (streaming with fitting on): a request whose need (prompt + output budget) passes this many tokens
    # is staged in a part of its own (`is_held`), not handed to the engines while ingest runs.
    hold_above: int | None = None
    # A dataset job (pipeline/datasets/): each table row is rendered into a request, and its kept columns are
    # staged beside it (`_staging/rows/`) for finalize to join with the answers.
    dataset: DatasetConfig | None = None

    def renderer(self) -> RowRenderer | None:
        if self.dataset is None:
            return None
        return RowRenderer(self.dataset, self.limits.max_json_depth)

    def kept_rows(self, piece: InputPiece) -> KeptRows | None:
        """Where a piece's kept rows gather: typed as the table when every input file is Parquet, JSON text when
        any is JSONL (its objects have no one schema)."""
        if self.dataset is None:
            return None
        source = self.source
        if (
            all(source.file_format(i) == "parquet" for i in range(len(source.files)))
            and piece.kind == "parquet"
        ):
            schema = source._parquet_file(source.files[piece.file]).schema_arrow  # noqa: SLF001 - its footer
            return KeptRows(kept_struct(schema, self.dataset.keep_columns))
        return KeptRows(None, self.dataset.keep_columns)


# --- step 1: scan -----------------------------------------------------------------------------------------------


@dataclass
class ScanOutcome:
    counts: list[tuple[list[int], str | None]]  # per range: (newlines per segment, sha256 or None)


def scan_ranges(job: IngestJob, ranges: list[ByteRange]) -> ScanOutcome:
    return ScanOutcome([job.source.scan(r) for r in ranges])


# --- step 2: read ---------------------------------------------------------------------------------------------------


@dataclass
class PieceStats:
    """What one read task returns: counts, never rows."""

    piece: int
    rows: int = 0
    valid: int = 0
    keyed: int = 0
    invalid_by_code: Counter = field(default_factory=Counter)
    parts: list[str] = field(default_factory=list)  # the request and error parts it staged
    held: int = 0  # requests staged in held parts (past the early fit's context)
    size_bytes: int = 0  # http: the bytes downloaded
    fingerprint: str = ""  # http: the input's fingerprint (known once downloaded)
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    measure_seconds: float = 0.0
    tokenizer_loads: int = 0


class _PieceOutput:
    """What one piece stages: request and error parts of at most `part_rows` rows, named after the piece."""

    def __init__(self, job: IngestJob, piece: InputPiece, stats: PieceStats) -> None:
        self.job = job
        self.piece = piece
        self.stats = stats
        self.ids = IdRows(piece.index, job.buckets)
        self.requests: list[tuple[str, str, str, int, str, str | None, str | None, int | None]] = []
        self.held: list[tuple[str, str, str, int, str, str | None, str | None, int | None]] = []
        self.errors: list[StagedRow] = []
        self.kept = job.kept_rows(piece)
        self._seq = {"part": 0, HELD: 0, INGEST_PREFIX: 0, "rows": 0}

    def _name(self, prefix: str) -> str:
        self._seq[prefix] += 1
        if prefix == HELD:
            return f"part-{self.piece.index:06d}-{HELD}{self._seq[prefix]:04d}.parquet"
        return f"{prefix}-{self.piece.index:06d}-{self._seq[prefix]:04d}.parquet"

    def request(self, request: ValidRequest, body: str, key: str | None, held: bool = False) -> None:
        model = request.body.get("model")  # the served model it runs on (a pool serving that model takes it)
        budget = requested_max_tokens(request.body)
        row = (request.custom_id, request.url, body, request.line, request.source, key, model, budget)
        self.stats.valid += 1
        if held:
            self.held.append(row)
            self.stats.held += 1
            if len(self.held) >= self.job.part_rows:
                self._flush(self.held, HELD)
            return
        self.requests.append(row)
        if len(self.requests) >= self.job.part_rows:
            self.flush_requests()

    def error(self, row: StagedRow, code: str) -> None:
        self.errors.append(row)
        self.stats.invalid_by_code[code] += 1
        if len(self.errors) >= self.job.part_rows:
            self.flush_errors()

    def flush_requests(self) -> None:
        self._flush(self.requests, "part")

    def _flush(self, rows: list, prefix: str) -> None:
        import pyarrow as pa

        if rows:
            name = self._name(prefix)
            columns = zip(*rows, strict=True)
            table = pa.table(dict(zip(REQUEST_SCHEMA.names, columns, strict=True)), schema=REQUEST_SCHEMA)
            self.job.staging.write_requests(table, name=name)
            self.stats.parts.append(f"{self.job.staging.requests_dir}/{name}")
            rows.clear()

    def keep(self, custom_id: str | None, source: str, line: int, row: dict | None) -> None:
        """A dataset row's kept columns, staged under the id its answer or error record carries."""
        assert self.kept is not None
        self.kept.add(custom_id, source, line, row)
        if len(self.kept) >= self.job.part_rows:
            self.flush_kept()

    def flush_kept(self) -> None:
        if self.kept is not None and len(self.kept):
            self.job.staging.write_kept_rows(self.kept.table(), self._name("rows"))
            self.kept.clear()

    def flush_errors(self) -> None:
        if self.errors:
            name = self._name(INGEST_PREFIX)
            self.job.staging.write_rows("errors", self.errors, name=name)
            self.stats.parts.append(f"{self.job.staging.errors_dir}/{name}")
            self.errors = []

    def close(self) -> None:
        self.flush_requests()
        self._flush(self.held, HELD)
        self.flush_errors()
        self.flush_kept()
        self.ids.write(self.job.staging)


class _Measure:
    """Measures valid requests a batch at a time, as fitting would (ingest/measure.measure): too-long ones become errors."""

    def __init__(self, spec: MeasureSpec, out: _PieceOutput, job_id: str | None) -> None:
        self.spec = spec
        self.target = spec.target()
        self.out = out
        self.job_id = job_id
        self.hold_above = out.job.hold_above
        self.pending: list[tuple[ValidRequest, str, str | None]] = []
        self.seconds = 0.0

    def add(self, request: ValidRequest, body: str, key: str | None) -> None:
        self.pending.append((request, body, key))
        if len(self.pending) >= MEASURE_BATCH:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        started = time.monotonic()
        target, limit, out, file = self.target, self.spec.limit, self.out, self.out.piece.file
        counts = target.count([(request.url, request.body) for request, _, _ in self.pending])
        for (request, body, key), prompts in zip(self.pending, counts, strict=True):
            custom_id = request.custom_id
            if isinstance(prompts, Exception):  # left to the engine, which rejects it with its own message
                out.ids.add(custom_id, file, request.line, None, key is not None, UNTOKENIZABLE)
                out.request(request, body, key)
                continue
            problem = prompts and context_problem(max(prompts), requested_max_tokens(request.body), limit)
            if problem:
                code = ErrorCode.CONTEXT_LENGTH_EXCEEDED
                seed = f"{self.job_id}:{custom_id}" if self.job_id else None
                record = failed_request_record(custom_id, code, problem, seed=seed)
                row = StagedRow(custom_id, request.line, request.source, code.value, 0, 0, "", dumps(record))
                out.ids.add(custom_id, file, request.line, code.value, key is not None)
                out.error(row, code.value)
                continue
            output, assumed = target.output_budget(request.url, request.body)
            longest = max(prompts) if prompts else 0
            capped = bool(prompts) and longest + output > limit
            measured = (False, len(prompts), sum(prompts), longest, output, assumed, capped)
            out.ids.add(custom_id, file, request.line, None, key is not None, measured)
            held = self.hold_above is not None and bool(prompts) and longest + output > self.hold_above
            out.request(request, body, key, held)
        self.pending = []
        self.seconds += time.monotonic() - started


def read_piece(job: IngestJob, piece: InputPiece) -> PieceStats:
    """Step 2 for one piece: validate, key, measure and stage its rows; write its id claims to the buckets."""
    started, cpu = time.monotonic(), time.process_time()
    loaded_before = tokenizers_loaded()
    stats = PieceStats(piece.index)
    source, file = job.source, piece.file
    source.limits = job.limits  # the reader enforces the line-length bound, the validator the rest
    validator = LineValidator(job.served, job.job_id, job.limits)
    out = _PieceOutput(job, piece, stats)
    measure = _Measure(job.measure, out, job.job_id) if job.measure is not None else None
    read = ReadStats()
    renderer = job.renderer()
    for name, number, payload in source.piece_rows(piece, read):
        stats.rows += 1
        if renderer is not None:  # a table's row: made a request here, its kept columns staged beside it
            payload, values = renderer.read(payload, number, file)
        if isinstance(payload, BadRow):
            outcome, claim = bad_row_check(payload, number, name, job.job_id)
        else:
            outcome, claim = validator.check(payload, number, name)
        if renderer is not None:
            staged_id = (
                outcome.custom_id if isinstance(outcome, ValidRequest) else outcome.record["custom_id"]
            )
            out.keep(staged_id, name, number, renderer.kept(values))
        if isinstance(outcome, ValidRequest):
            key = routing_key(outcome.url, outcome.body, job.adapters)
            stats.keyed += key is not None
            body = dumps_body(outcome.body, payload)  # a valid outcome never comes from a BadRow
            if measure is not None:
                measure.add(outcome, body, key)
            else:
                out.ids.add(outcome.custom_id, file, number, None, key is not None)
                out.request(outcome, body, key)
        else:
            if claim is not None:
                out.ids.add(claim, file, number, outcome.code)
            out.error(invalid_to_staged(outcome), outcome.code)
    if measure is not None:
        measure.flush()
        stats.measure_seconds = measure.seconds
    out.close()
    stats.size_bytes, stats.fingerprint = read.size_bytes, read.fingerprint
    stats.tokenizer_loads = tokenizers_loaded() - loaded_before
    stats.seconds, stats.cpu_seconds = time.monotonic() - started, time.process_time() - cpu
    return stats


# --- steps 3 and 4: duplicates ----------------------------------------------------------------------------------------


def dedup_bucket(job: IngestJob, bucket: int) -> BucketOutcome:
    sources = [file.name for file in job.source.files]
    return find_duplicates(job.staging, bucket, sources, job.job_id, job.part_rows)


def fix_piece(job: IngestJob, item: tuple[int, list[str]]) -> int:
    """Step 4 for one piece: what it staged for its losing lines removed; returns the rows removed."""
    piece, parts = item
    return drop_losers(job.staging, piece, parts)


def _drop_results_task(job: IngestJob, parts: list[str]) -> int:
    return drop_loser_results(job.staging, parts, request_losers(job.staging))


def _drop_loser_results(run: TaskExecutor, job: IngestJob) -> int:
    """Rows the engines staged for requests that lost their custom_id, dropped (tasks over the engines' parts)."""
    staging = job.staging
    if not request_losers(staging).num_rows:
        return 0
    engine_parts = staging.engine_parts()
    groups = [
        engine_parts[i : i + SETTLE_PARTS_PER_TASK]
        for i in range(0, len(engine_parts), SETTLE_PARTS_PER_TASK)
    ]
    return sum(run.map(_drop_results_task, job, groups))


def _piece_of(path: str) -> int:
    return int(path.rsplit("/", 1)[-1].split("-")[1])


def held_requests(staging: StagingArea) -> list[str]:
    """The request parts of requests held back by an early fit (none otherwise)."""
    return [part for part in staging.request_files() if is_held(part)]


def is_held(path: str) -> bool:
    """Whether a request part holds requests past the early fit's context (`part-<p>-held<seq>[d].parquet`)."""
    return f"-{HELD}" in path.rsplit("/", 1)[-1]


def settle_losers(staging: StagingArea, source: InputSource, parallel: bool | None = None) -> int:
    """After a streamed ingest (see runtime/ingest/dedup.py), once no engine reads the work list: requests that lost their
    custom_id leave the work list, and the rows engines made of them leave staging. Idempotent; a no-op when there
    is nothing to settle. Returns the engine rows dropped."""
    found = staging.files.list_parts(losers_dir(staging))
    if not found:
        staging.files.delete_tree(staging.ids_dir)
        return 0
    run = _executor(parallel, source, staging)
    job = IngestJob(source, staging, {}, None, source.limits, None, 1, 0)
    with_losers = {_piece_of(path) for path in found}  # piece-<p>-bucket-<k>.parquet
    by_piece: dict[int, list[str]] = {}
    for part in staging.request_files():  # part-<p>-<seq>[d].parquet
        if _piece_of(part) in with_losers:
            by_piece.setdefault(_piece_of(part), []).append(part)
    run.map(fix_piece, job, sorted(by_piece.items()))
    dropped = _drop_loser_results(run, job)
    staging.files.delete_tree(staging.ids_dir)
    return dropped


# --- where the tasks run -------------------------------------------------------------------------------------------


def _executor(
    parallel: bool | None, source: InputSource, staging: StagingArea, reserve_cpus: bool = True
) -> TaskExecutor:
    """Ray tasks when Ray is initialized (unless `parallel` is False), else a loop in this process."""
    placement = ray_placement(on_drivers_disk(source, staging)) if parallel is not False else None
    return TaskExecutor(placement, reserve_cpus)


def on_drivers_disk(source: InputSource, staging: StagingArea) -> bool:
    """Whether ingest touches the driver's disk: a local input or a local staging area (nodes on other hosts cannot
    read it; nodes on the driver's host can)."""
    return source.kind == "local" or isinstance(staging.files, LocalFiles)


def ramp(range_bytes: int, workers: int) -> list[int]:
    """The sizes of a streamed job's first byte ranges: RAMP_BYTES for each worker, doubling up to `range_bytes`, so
    the first requests reach the engines a fraction of a second after reading starts, and later ranges are large
    enough that their tasks cost little."""
    sizes: list[int] = []
    size = RAMP_BYTES
    while size < range_bytes:
        sizes += [size] * workers
        size *= 2
    return sizes


def _scan_batches(scans: list[ByteRange]) -> list[list[ByteRange]]:
    """Scans grouped into tasks of at most HASH_RANGE_BYTES (many small files share a task)."""
    batches: list[list[ByteRange]] = []
    size = 0
    for byte_range in scans:
        length = byte_range.end - byte_range.start
        if not batches or size + length > HASH_RANGE_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(byte_range)
        size += length
    return batches


def _count(placement: dict[str, dict[str, int]], step: str, nodes: Counter[str]) -> None:
    if nodes:
        placement[step] = dict(nodes)


# --- the early fit's sample ---------------------------------------------------------------------------------------


def sample_input(
    location: InputSource,
    served: str | Mapping[str, str | None],
    staging: StagingArea,
    measure: MeasureSpec,
    job_id: str | None = None,
    parallel: bool | None = None,
    reserve_cpus: bool = True,
    dataset: DatasetConfig | None = None,
) -> Sample:
    """A measured sample spread over the input (runtime/ingest/sample.py), as one task: what the early fit decides
    from before ingest reads the whole input."""
    source = location
    size = source.size_bytes or 0
    range_bytes = max(SAMPLE_RANGE_BYTES, size // SAMPLE_PIECES)
    pieces, _ = source.plan_reads(range_bytes, piece_rows=1)
    job = IngestJob(source, staging, served, job_id, source.limits, measure, 1, 0, dataset=dataset)
    run = _executor(parallel, source, staging, reserve_cpus)
    (sample,) = run.map(measure_sample, job, [sample_pieces(pieces)])
    return sample


# --- the whole pass -------------------------------------------------------------------------------------------------


def ingest(
    location: InputSource | Path | str,
    served: str | Mapping[str, str | None],
    staging: StagingArea,
    part_rows: int = 50_000,
    storage: StorageConfig | None = None,
    job_id: str | None = None,
    limits: InputLimits | None = None,
    measure: MeasureSpec | None = None,
    range_bytes: int | None = None,
    buckets: int | None = None,
    parallel: bool | None = None,
    reserve_cpus: bool = True,
    on_requests: Callable[[list[str]], None] | None = None,
    adapters: frozenset[str] = frozenset(),
    hold_above: int | None = None,
    dataset: DatasetConfig | None = None,
) -> IngestReport:
    """Validate (and, with `measure`, measure) the whole input into staging, as parallel tasks on Ray when it is
    initialized (`parallel` None), else in this process. Staging must hold no earlier ingest (discard_ingest).
    `reserve_cpus=False`: the tasks take no Ray CPU (engines already hold them; at most twice the cluster's CPUs
    run at once either way).
    `on_requests`: streaming — called with each piece's request parts as soon as they are staged (engines take them
    while the rest is read); requests that turn out to have lost their custom_id stay in the work list until
    `settle_losers`. `adapters`: the LoRA adapter names among the served ones (their rows are routed by adapter).
    `hold_above` (early fit): requests needing more tokens than that are staged in held parts (`is_held`), never
    handed over; they run once the whole input is fitted."""
    source = as_source(location, storage)
    source.limits = limits or InputLimits()
    run = _executor(parallel, source, staging, reserve_cpus)
    if range_bytes is None:
        share = math.ceil((source.size_bytes or 0) / (8 * run.parallelism))
        range_bytes = min(RANGE_BYTES, max(MIN_RANGE_BYTES, share))
    report = IngestReport(
        source=str(location) if isinstance(location, Path | str) else source.describe(),
        files=len(source.files),
        range_bytes=range_bytes,
    )
    started = time.monotonic()
    lead = ramp(range_bytes, run.parallelism) if on_requests is not None else ()
    pieces, scans = source.plan_reads(range_bytes, lead=lead)
    if buckets is None:
        # Enough buckets to keep each one's ids small, and to give every worker a bucket when there are pieces
        # enough to fill them (each piece writes one file per bucket it has ids in).
        by_size = math.ceil((source.size_bytes or 0) / BUCKET_BYTES)
        buckets = max(1, min(MAX_BUCKETS, max(by_size, min(len(pieces), run.parallelism))))
    job = IngestJob(
        source,
        staging,
        served,
        job_id,
        source.limits,
        measure,
        buckets,
        part_rows,
        adapters,
        hold_above,
        dataset,
    )
    batches = _scan_batches(scans)
    scan_nodes: Counter[str] = Counter()
    scanned = run.map(scan_ranges, job, batches, tasks_by_node=scan_nodes)
    counts = [count for outcome in scanned for count in outcome.counts]
    pieces = with_line_counts(pieces, scans, [newlines for newlines, _ in counts])
    report.seconds["scan"] = time.monotonic() - started
    _count(report.placement, "scan", scan_nodes)

    started = time.monotonic()
    requests_dir = staging.requests_dir

    def hand_over(stats: PieceStats) -> None:
        if on_requests is not None:
            mine = [part for part in stats.parts if part.startswith(requests_dir) and not is_held(part)]
            if mine:
                on_requests(mine)

    read_nodes: Counter[str] = Counter()
    read: list[PieceStats] = run.map(read_piece, job, pieces, hand_over, tasks_by_node=read_nodes)
    report.seconds["read"] = time.monotonic() - started
    _count(report.placement, "read", read_nodes)

    started = time.monotonic()
    dedup_nodes: Counter[str] = Counter()
    found: list[BucketOutcome] = run.map(dedup_bucket, job, list(range(buckets)), tasks_by_node=dedup_nodes)
    parts = {stats.piece: stats.parts for stats in read}
    fixes = sorted({piece for outcome in found for piece in outcome.pieces})
    if on_requests is not None:  # handed over already: their losers are settled once the engines are done
        parts = {
            piece: [p for p in mine if not p.startswith(requests_dir) or is_held(p)]
            for piece, mine in parts.items()
        }
    run.map(fix_piece, job, [(piece, parts[piece]) for piece in fixes], tasks_by_node=dedup_nodes)
    if on_requests is None:
        # A job resumed after a streamed run was cut short may hold rows its engines made of losing requests.
        _drop_loser_results(run, job)
        staging.files.delete_tree(staging.ids_dir)
    else:
        for bucket in range(buckets):
            staging.files.delete_tree(bucket_dir(staging, bucket))
    report.seconds["dedup"] = time.monotonic() - started
    _count(report.placement, "dedup", dedup_nodes)

    for stats in read:
        report.lines += stats.rows
        report.valid += stats.valid
        report.keyed += stats.keyed
        report.invalid_by_code.update(stats.invalid_by_code)
        report.tokenizer_loads += stats.tokenizer_loads
        report.held += stats.held
        report.task_cpu_s += stats.cpu_seconds
    lengths = Lengths()
    for outcome in found:
        lengths.merge(outcome.lengths)
        report.valid -= outcome.replaced.get(REQUEST, 0)
        report.keyed -= outcome.replaced_keyed
        report.invalid_by_code.subtract({c: n for c, n in outcome.replaced.items() if c != REQUEST})
        report.invalid_by_code[ErrorCode.DUPLICATE_CUSTOM_ID.value] += outcome.duplicates
    report.invalid_by_code = +report.invalid_by_code  # drop codes that no line has any more
    if measure is not None:
        lengths.seconds = sum(stats.measure_seconds for stats in read)
        report.lengths = lengths

    if source.kind == "local":
        report.fingerprint = source.local_fingerprint(scans, [digest or "" for _, digest in counts])
        report.size_bytes = source.size_bytes or 0
    elif source.kind == "s3":
        report.fingerprint = source.s3_fingerprint()
        report.size_bytes = source.size_bytes or 0
    else:
        report.fingerprint = read[0].fingerprint
        report.size_bytes = read[0].size_bytes
    return report
