"""One batch job, end to end: preflight → ingest → engines (Ray Data actor pool) → stage → finalize.

    read ─▶ validate ─▶ route ─▶ engine actors ─▶ stage ─▶ finalize

The driver streams: it validates the input into staging, hands Ray Data the staged work list, and writes
finished rows back into staging as they arrive. Nothing here holds the whole input or output in memory.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from pipeline import __version__
from pipeline.config import JobConfig
from pipeline.engines.base import EngineSpec, engine_class
from pipeline.io.files import atomic_write_json
from pipeline.io.staging import StagedRow, StagingArea
from pipeline.models import ResolvedModel, resolve_model
from pipeline.observe.progress import JobCounters, ProgressDisplay
from pipeline.runtime.finalize import FORMAT_VERSION, commit, write_outputs
from pipeline.runtime.ingest import IngestReport, ingest
from pipeline.runtime.monitor import summarize_engines
from pipeline.runtime.preflight import check_input, check_output

log = structlog.get_logger(__name__)


@dataclass
class JobOutcome:
    output: Path
    manifest: dict[str, Any]
    counters: JobCounters
    pools: dict[str, dict[str, float]] = field(default_factory=dict)


def engine_spec(config: JobConfig, model: ResolvedModel) -> EngineSpec:
    engine = config.engine
    args = engine.vllm.model_dump() if engine.backend == "vllm" else engine.fake.model_dump()
    if engine.backend == "fake" and engine.vllm.max_model_len:
        args["max_model_len"] = engine.vllm.max_model_len
    return EngineSpec(engine.backend, model.path, model.name, args)


def _start_ray(address: str | None) -> None:
    import logging
    import os

    # Ray's C++ core prints start-up chatter to the terminal unless told otherwise; set before Ray starts.
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    import ray
    from ray.data import DataContext

    if not ray.is_initialized():
        # Engine logs stay in Ray's session logs; the terminal shows nightshift's own progress and logs.
        # "local" starts a private instance: never attach by accident to a cluster someone else started here.
        ray.init(
            address=address or "local",
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.enable_auto_log_stats = False
    # Results are staged and sorted at the end; waiting for input order would hold every batch behind the slowest.
    ctx.execution_options.preserve_order = False
    # Without this, engines asking for resources no node has would wait forever in silence.
    ctx.wait_for_min_actors_s = 300


class _StagingBuffer:
    """Finished rows waiting to become a staged part: flushed by size or age (the checkpoint cadence)."""

    def __init__(self, staging: StagingArea, max_rows: int, max_age_s: float = 10.0) -> None:
        self.staging = staging
        self.max_rows = max_rows
        self.max_age_s = max_age_s
        self.results: list[StagedRow] = []
        self.errors: list[StagedRow] = []
        self._since = time.monotonic()

    def add(self, row: StagedRow) -> None:
        (self.errors if row.error_code else self.results).append(row)
        if (
            len(self.results) + len(self.errors) >= self.max_rows
            or time.monotonic() - self._since > self.max_age_s
        ):
            self.flush()

    def flush(self) -> None:
        self.staging.write_rows("results", self.results)
        self.staging.write_rows("errors", self.errors)
        self.results, self.errors = [], []
        self._since = time.monotonic()


def _run_engines(
    config: JobConfig, spec: EngineSpec, staging: StagingArea, counters: JobCounters, show_progress: bool
) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    import ray

    from pipeline.runtime.monitor import EngineMonitor
    from pipeline.runtime.worker import EngineWorker

    files = staging.request_files()
    if not files:
        return {}, {}
    res = config.resources
    in_flight = config.engine.in_flight()
    batch_size = max(1, min(res.rows_per_task, in_flight))
    # Enough overlapping calls per actor that `in_flight` requests are always with the engine.
    calls_per_actor = max(2, -(-in_flight // batch_size))

    monitor = ray.remote(num_cpus=0)(EngineMonitor).remote()
    # Ray Data streams a task's output only when the task ends, so blocks of one batch each let finished rows
    # flow back continuously while the actor overlaps many such calls.
    ds = ray.data.read_parquet(files).repartition(target_num_rows_per_block=batch_size)
    ds = ds.map_batches(
        EngineWorker,
        fn_constructor_kwargs={"spec": spec, "pool": "default", "monitor": monitor},
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(
            size=res.num_engines, max_concurrent_calls_per_actor=calls_per_actor
        ),
        num_cpus=res.cpus_per_engine,
        num_gpus=res.gpus_per_engine or None,
        resources=res.resources_per_engine or None,
        batch_format="numpy",
        zero_copy_batch=True,
    )
    buffer = _StagingBuffer(staging, config.output_options.staging_rows)
    pools: dict[str, dict[str, float]] = {}
    with ProgressDisplay(counters, enabled=show_progress) as progress:
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            columns = batch.to_pydict()
            failed = prompt = completion = 0
            for values in zip(*(columns[name] for name in columns), strict=True):
                row = StagedRow(**dict(zip(columns, values, strict=True)))
                buffer.add(row)
                failed += bool(row.error_code)
                prompt += row.prompt_tokens
                completion += row.completion_tokens
                pool = pools.setdefault(row.pool, {"rows": 0, "prompt_tokens": 0, "completion_tokens": 0})
                pool["rows"] += 1
                pool["prompt_tokens"] += row.prompt_tokens
                pool["completion_tokens"] += row.completion_tokens
            counters.add(batch.num_rows, failed, prompt, completion)
            progress.update()
        buffer.flush()
        progress.update(force=True)
    snapshot = ray.get(monitor.snapshot.remote())
    return snapshot, pools


def run_job(config: JobConfig, show_progress: bool = True) -> JobOutcome:
    started_at = dt.datetime.now(dt.timezone.utc)
    t0 = time.monotonic()
    input_path = check_input(config.input)
    output = check_output(config.output, config.overwrite)
    model = resolve_model(config.model, config.served_model_name)
    spec = engine_spec(config, model)
    engine_class(spec.backend).check_spec(spec)

    staging = StagingArea(output)
    staging.create()
    atomic_write_json(
        staging.job_file, {"config": config.model_dump(mode="json"), "model": model.model_dump()}
    )
    report: IngestReport = ingest(input_path, model.name, staging)
    atomic_write_json(
        staging.job_file,
        {
            "config": config.model_dump(mode="json"),
            "model": model.model_dump(),
            "input": {
                "fingerprint": report.fingerprint,
                "size_bytes": report.size_bytes,
                "lines": report.lines,
            },
        },
    )
    log.info("input validated", lines=report.lines, valid=report.valid, invalid=report.invalid)

    counters = JobCounters(total=report.lines)
    counters.add_invalid(report.invalid)
    snapshot: dict[str, Any] = {}
    pools: dict[str, dict[str, float]] = {}
    if report.valid:
        _start_ray(config.resources.address)
        snapshot, pools = _run_engines(config, spec, staging, counters, show_progress)

    outputs = write_outputs(output, staging, config.output_options.rows_per_shard, report.lines)
    wall = time.monotonic() - t0
    engines = summarize_engines(snapshot)
    for stats in pools.values():
        stats["output_tokens_per_s"] = round(stats["completion_tokens"] / wall, 2) if wall else 0.0
    manifest = {
        "format_version": FORMAT_VERSION,
        "nightshift_version": __version__,
        "created_at": started_at.isoformat(),
        "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        "input": {
            "location": str(input_path.resolve()),
            "fingerprint": report.fingerprint,
            "size_bytes": report.size_bytes,
            "lines": report.lines,
        },
        "model": model.model_dump(),
        "engine": {
            "backend": spec.backend,
            "args": engines.get("effective_args") or spec.args,
            "sampling_defaults": engines.get("sampling_defaults", {}),
            "engines": engines.get("engines", 0),
            "kv_cache_tokens_per_engine": engines.get("kv_cache_tokens_per_engine"),
        },
        **outputs,
        "tokens": {"prompt": counters.prompt_tokens, "completion": counters.completion_tokens},
        "wall_time_s": round(wall, 3),
        "throughput": {
            "rows_per_s": round(report.lines / wall, 2) if wall else 0.0,
            "output_tokens_per_s": round(counters.completion_tokens / wall, 2) if wall else 0.0,
        },
        "preemptions": engines.get("num_preemptions", 0),
        "prefix_cache_hit_rate": engines.get("prefix_cache_hit_rate"),
        "pools": pools,
    }
    commit(output, staging, manifest)
    return JobOutcome(output, manifest, counters, pools)
