"""One batch job, end to end: preflight → ingest → engines (Ray Data actor pool) → stage → finalize.

    read ─▶ validate ─▶ (resume filter) ─▶ engine actors ─▶ stage ─▶ finalize

The driver streams: it validates the input into staging, hands Ray Data the staged work list, and writes
finished rows back into staging as they arrive. Nothing here holds the whole input or output in memory.
Staging is the checkpoint: a job interrupted at any point is continued by `resume`, which re-runs only the
requests that have no staged row yet.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from pipeline import __version__
from pipeline.config import JobConfig, PoolConfig, effective_pools
from pipeline.engines.base import EngineSpec, engine_class
from pipeline.io.locations import RetryStats
from pipeline.io.readers import InputSource
from pipeline.io.staging import StagedRow, StagingArea
from pipeline.io.writers import OutputTarget, output_target
from pipeline.models import ResolvedModel, resolve_model
from pipeline.observe.progress import JobCounters, ProgressDisplay
from pipeline.runtime.finalize import FORMAT_VERSION, commit, write_outputs
from pipeline.runtime.fit import fit_job
from pipeline.runtime.ingest import ingest
from pipeline.runtime.monitor import EngineWatch, preemption_remedy, summarize_engines
from pipeline.runtime.preflight import PreflightError, check_input_source, check_output_target

log = structlog.get_logger(__name__)


@dataclass
class JobOutcome:
    output: Path | str  # a local directory, or the s3:// / http(s):// URL
    manifest: dict[str, Any]
    counters: JobCounters
    pools: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class EngineRun:
    """What the engine phase reports back to the manifest."""

    snapshot: dict[str, Any] = field(default_factory=dict)
    pools: dict[str, dict[str, float]] = field(default_factory=dict)
    retried_requests: int = 0
    duplicates_dropped: int = 0
    preemption_warned: bool = False  # the live warning went out already


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


def _pending_work(staging: StagingArea, finished: set[str]) -> list[str]:
    """The request parts still to run: all of them on a fresh job; on resume, filtered copies without the
    requests that already have a staged row (so finished work is never recomputed)."""
    files = staging.request_files()
    if not finished:
        return files
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    done = pa.array(sorted(finished), type=pa.string())
    pending_dir = staging.root / f"pending-{uuid.uuid4().hex[:8]}"
    pending_dir.mkdir()
    pending = []
    for i, path in enumerate(files):
        table = pq.read_table(path)
        left = table.filter(pc.invert(pc.is_in(table.column("custom_id"), value_set=done)))
        if left.num_rows:
            target = pending_dir / f"part-{i:06d}.parquet"
            pq.write_table(left, target)
            pending.append(str(target))
    return pending


@dataclass(frozen=True)
class PoolPlan:
    """How one pool runs: its engine spec and how much work its engines keep in flight."""

    pool: PoolConfig
    spec: EngineSpec
    batch_size: int  # rows per Ray Data batch (one queue chunk)
    calls_per_actor: int  # batches each engine actor works on at once
    max_engines: int

    @property
    def credit(self) -> int:
        """Rows the pool may hold at once: what its engines can work on, plus a batch each to hide the latency."""
        return self.max_engines * (self.calls_per_actor + 1) * self.batch_size


def plan_pool(config: JobConfig, spec: EngineSpec, pool: PoolConfig) -> PoolPlan:
    spec = replace(spec, args={**spec.args, **pool.engine_overrides})
    limit = spec.args.get("max_num_seqs") or spec.args.get("max_concurrency") or 64
    in_flight = config.engine.max_in_flight or 2 * int(limit)
    # Chunks are one batch each, because Ray Data hands a task's output on only when the task ends: small chunks
    # keep finished rows flowing back. Enough overlapping calls per actor that `in_flight` requests are always
    # with the engine, so its continuous batching stays full across batch boundaries.
    batch_size = max(1, min(config.resources.rows_per_task, in_flight))
    calls_per_actor = max(2, -(-in_flight // batch_size))
    return PoolPlan(pool, spec, batch_size, calls_per_actor, pool.max_engines or pool.min_engines)


def _pool_dataset(plan: PoolPlan, queue: Any, monitor: Any, job_id: str, pending_rows: int):
    """One pool's pipeline: pull chunks from the shared queue → its engine actors."""
    import ray

    from pipeline.runtime.work_queue import queue_datasource
    from pipeline.runtime.worker import EngineWorker

    pool = plan.pool
    # Each read task pulls one chunk; a few at a time per engine is plenty of supply, and the queue's credit (not
    # the number of readers) bounds how much work the pool holds.
    tasks = max(1, -(-pending_rows // plan.batch_size))
    source = queue_datasource(queue, pool.name, read_tasks=tasks, chunk_rows=plan.batch_size)
    ds = ray.data.read_datasource(
        source, num_cpus=0, override_num_blocks=tasks, concurrency=2 * plan.max_engines
    )
    return ds.map_batches(
        EngineWorker,
        fn_constructor_kwargs={
            "spec": plan.spec,
            "pool": pool.name,
            "monitor": monitor,
            "job_id": job_id,
            "queue": queue,
        },
        batch_size=plan.batch_size,
        compute=ray.data.ActorPoolStrategy(
            min_size=pool.min_engines,
            max_size=plan.max_engines,
            max_concurrent_calls_per_actor=plan.calls_per_actor,
        ),
        num_cpus=pool.cpus_per_engine,
        num_gpus=pool.gpus_per_engine or None,
        resources=pool.resources_per_engine or None,
        accelerator_type=pool.accelerator_type,
        batch_format="numpy",
        zero_copy_batch=True,
    )


def _run_engines(
    config: JobConfig,
    spec: EngineSpec,
    staging: StagingArea,
    counters: JobCounters,
    show_progress: bool,
    job_id: str,
    finished: set[str],
) -> EngineRun:
    import pyarrow.parquet as pq
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pipeline.runtime.monitor import JobMonitor
    from pipeline.runtime.work_queue import WorkQueue

    files = _pending_work(staging, finished)
    if not files:
        return EngineRun()
    pools = effective_pools(config)
    # The monitor and the queue are pinned to the driver's node: they must not go down with a worker node (that
    # is what they help survive), and the queue reads the staged work list from this node's disk.
    # The monitor is named so operators (and tests) can find a job's engines: ray.get_actor(name).snapshot().
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    monitor = (
        ray.remote(num_cpus=0)(JobMonitor)
        .options(name=f"nightshift-monitor-{job_id}", scheduling_strategy=here)
        .remote()
    )
    plans = [plan_pool(config, spec, pool) for pool in pools]
    credit = {plan.pool.name: plan.credit for plan in plans}
    queue = ray.remote(num_cpus=0)(WorkQueue).options(scheduling_strategy=here).remote(files, credit)
    pending_rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    datasets = [_pool_dataset(plan, queue, monitor, job_id, pending_rows) for plan in plans]
    ds = datasets[0].union(*datasets[1:]) if len(datasets) > 1 else datasets[0]

    buffer = _StagingBuffer(staging, config.output_options.staging_rows)
    run = EngineRun()
    # A re-executed Ray task (lost node, lineage reconstruction) could hand back rows already seen; the contract
    # is exactly-once, so the driver keeps the ids it staged and drops repeats.
    staged = set(finished)
    started = time.monotonic()
    # Live engine numbers (KV usage, preemptions, prefix hits) in the display and logs; warns once on preemptions.
    watch = EngineWatch.of_monitor(monitor, staging.read_job().get("fit"))
    with ProgressDisplay(counters, enabled=show_progress, engines=watch.poll) as progress:
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            columns = batch.to_pydict()
            rows = failed = prompt = completion = 0
            for values in zip(*(columns[name] for name in columns), strict=True):
                row = StagedRow(**dict(zip(columns, values, strict=True)))
                if row.custom_id in staged:
                    run.duplicates_dropped += 1
                    continue
                staged.add(row.custom_id)
                buffer.add(row)
                rows += 1
                failed += bool(row.error_code)
                prompt += row.prompt_tokens
                completion += row.completion_tokens
                pool = run.pools.setdefault(
                    row.pool, {"rows": 0, "prompt_tokens": 0, "completion_tokens": 0, "first_result_s": None}
                )
                pool["rows"] += 1
                pool["prompt_tokens"] += row.prompt_tokens
                pool["completion_tokens"] += row.completion_tokens
                elapsed = round(time.monotonic() - started, 3)
                if pool["first_result_s"] is None:
                    pool["first_result_s"] = elapsed
                pool["last_result_s"] = elapsed
            counters.add(rows, failed, prompt, completion)
            progress.update(pools=run.pools)
        buffer.flush()
        progress.update(force=True, pools=run.pools)
    for name, stats in run.pools.items():
        stats["engines"] = sum(
            1 for info in ray.get(monitor.snapshot.remote()).values() if info["pool"] == name
        )
        span = stats.get("last_result_s") or 0
        stats["output_tokens_per_s"] = round(stats["completion_tokens"] / span, 2) if span else 0.0
    run.snapshot = ray.get(monitor.snapshot.remote())
    run.retried_requests = len(ray.get(monitor.retries.remote()))
    run.preemption_warned = watch.warned
    for actor in (monitor, queue):
        ray.kill(actor)
    if run.duplicates_dropped:
        log.warning("dropped rows re-delivered by retried tasks", rows=run.duplicates_dropped)
    return run


def _prepare(
    config: JobConfig, resume: bool
) -> tuple[InputSource, OutputTarget, StagingArea, dict[str, Any]]:
    """Preflight, then either a fresh job spec or the stored one of the job being resumed."""
    source = check_input_source(config.input, config.storage)
    output = check_output_target(config.output, config.overwrite, config.storage, resume=resume)
    staging = output.staging_area()
    if resume and staging.exists():
        state = staging.read_job()
        stored = state.get("input", {}).get("fingerprint")
        if stored:
            current = source.fingerprint()
            if current != stored:
                raise PreflightError(
                    f"input {config.input} changed since the job started ({stored} → {current}); resuming would "
                    "mix two inputs. Restore the original input, or start a new job in another OUTPUT."
                )
        log.info("resuming job", job_id=state["job_id"], output=str(output))
        return source, output, staging, state
    if resume:
        raise PreflightError(
            f"output {config.output} holds no unfinished job (no _staging/): nothing to resume"
        )
    state = {"job_id": config.job_id or uuid.uuid4().hex[:16], "config": config.model_dump(mode="json")}
    return source, output, staging, state


def run_job(config: JobConfig, show_progress: bool = True, resume: bool = False) -> JobOutcome:
    """Run (or, with resume=True, continue) one job; returns when the output is committed."""
    started_at = dt.datetime.now(dt.timezone.utc)
    t0 = time.monotonic()
    retries_before = RetryStats.snapshot()
    source, output, staging, state = _prepare(config, resume)
    model = resolve_model(config.model, config.served_model_name)
    spec = engine_spec(config, model)
    engine_class(spec.backend).check_spec(spec)
    job_id = state["job_id"]

    staging.create()
    if not state.get("ingested"):
        # A validation pass cut short is redone whole: it is cheap next to generation, and partial parts of it
        # could otherwise be staged twice.
        staging.discard_ingest()
        state["model"] = model.model_dump()
        staging.write_job(state)
        report = ingest(source, model.name, staging, job_id=job_id)
        state["input"] = {
            "location": source.describe(),
            "fingerprint": report.fingerprint,
            "size_bytes": report.size_bytes,
            "lines": report.lines,
            "valid": report.valid,
            "invalid": report.invalid,
        }
        state["ingested"] = True
        staging.write_job(state)
    # Engine args fitted to the data, too-long prompts failed before any engine (runtime/fit.py; kept in state).
    config = fit_job(config, model, staging, state)
    spec = engine_spec(config, model)
    lines = state["input"]["lines"]
    log.info("input validated", lines=lines, valid=state["input"]["valid"], invalid=state["input"]["invalid"])

    finished = set(staging.finished_ids())
    counters = JobCounters(total=lines)
    counters.add_invalid(state["input"]["invalid"])
    counters.done += len(finished)
    run = EngineRun()
    if state["input"]["valid"] > len(finished):
        _start_ray(config.resources.address)
        run = _run_engines(config, spec, staging, counters, show_progress, job_id, finished)

    outputs = write_outputs(
        output, staging, config.output_options.rows_per_shard, lines, format=config.output_options.format
    )
    tokens = {
        "prompt": staging.column_sum("prompt_tokens"),
        "completion": staging.column_sum("completion_tokens"),
    }
    wall = time.monotonic() - t0
    engines = summarize_engines(run.snapshot)
    remedy = preemption_remedy(
        engines.get("num_preemptions", 0),
        engines.get("effective_args", {}),
        (state.get("fit") or {}).get("longest_sequence"),
    )
    if remedy and not run.preemption_warned:
        log.warning(remedy)
    manifest = {
        "format_version": FORMAT_VERSION,
        "nightshift_version": __version__,
        "job_id": job_id,
        "created_at": started_at.isoformat(),
        "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        "input": {k: state["input"][k] for k in ("location", "fingerprint", "size_bytes", "lines")},
        "model": model.model_dump(),
        "engine": {
            "backend": spec.backend,
            "args": engines.get("effective_args") or spec.args,
            "sampling_defaults": engines.get("sampling_defaults", {}),
            "engines": engines.get("engines", 0),
            "kv_cache_tokens_per_engine": engines.get("kv_cache_tokens_per_engine"),
            "kv_cache_usage_peak": engines.get("kv_cache_usage_peak"),
            "first_ready_at": _iso(engines.get("first_ready_at")),  # engine start ends, generation begins
            "fitted": state.get("fit"),
        },
        **outputs,
        # From staging, not from this run's counters: a resumed job's totals include the rows of earlier runs.
        "tokens": tokens,
        "wall_time_s": round(wall, 3),
        "throughput": {
            "rows_per_s": round(counters.done / wall, 2) if wall else 0.0,
            "output_tokens_per_s": round(counters.completion_tokens / wall, 2) if wall else 0.0,
        },
        "preemptions": engines.get("num_preemptions", 0),
        "preemption_warning": remedy,
        "prefix_cache_hit_rate": engines.get("prefix_cache_hit_rate"),
        "recovery": {
            "resumed": bool(resume),
            "rows_from_earlier_runs": len(finished),
            "requests_retried_after_engine_failure": run.retried_requests,
            "duplicate_deliveries_dropped": run.duplicates_dropped,
        },
        "pools": run.pools,
        "storage": RetryStats.since(retries_before),
    }
    commit(output, staging, manifest)
    return JobOutcome(output.where, manifest, counters, run.pools)


def _iso(epoch: float | None) -> str | None:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).isoformat() if epoch else None


def load_resumable(output: str) -> JobConfig:
    """The job spec stored in OUTPUT/_staging/job.json, for `nightshift resume OUTPUT`."""
    staging = output_target(output).staging_area()
    if not staging.exists():
        raise PreflightError(f"{output} holds no unfinished job (no _staging/): nothing to resume")
    try:
        state = staging.read_job()
    except FileNotFoundError as exc:
        raise PreflightError(str(exc)) from exc
    config = JobConfig.model_validate(state["config"])
    return config.model_copy(update={"output": output, "job_id": state["job_id"]})
