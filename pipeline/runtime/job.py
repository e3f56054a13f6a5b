"""One batch job, end to end: preflight → ingest → fit → engines (Ray Data actor pool) → stage → finalize.

    read ─▶ validate ─▶ fit ─▶ (resume filter) ─▶ engine actors ─▶ stage ─▶ finalize

The driver coordinates: it starts Ray, has the cluster validate and measure the input into staging
(runtime/ingest.py), fits the engine args to the measured aggregate, hands Ray Data the staged work list, and writes
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

import pyarrow as pa
import pyarrow.compute as pc
import structlog

from pipeline import __version__
from pipeline.config import JobConfig, PoolConfig, StorageConfig, effective_pools, merge_overrides
from pipeline.engines.base import EngineSpec, engine_class
from pipeline.io.locations import RetryStats
from pipeline.io.readers import InputSource
from pipeline.io.staging import StagingArea
from pipeline.io.writers import OutputTarget, output_target
from pipeline.models import ResolvedModel, resolve_model
from pipeline.observe.progress import JobCounters, ProgressDisplay
from pipeline.runtime.finalize import FORMAT_VERSION, commit, write_outputs
from pipeline.runtime.fit import fit_job, measuring
from pipeline.runtime.ingest import ingest
from pipeline.runtime.monitor import EngineWatch, preemption_remedy, summarize_engines, summarize_recovery
from pipeline.runtime.placement import place_pool
from pipeline.runtime.preflight import (
    PreflightError,
    check_input_source,
    check_output_target,
    output_problem,
)

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
    routing: dict[str, Any] = field(default_factory=dict)
    # Engines restarted, and those that died with rows in flight: where, why, and who re-ran the rows.
    recovery: dict[str, Any] = field(default_factory=lambda: summarize_recovery({}))


def engine_spec(config: JobConfig, model: ResolvedModel) -> EngineSpec:
    engine = config.engine
    args = engine.vllm.model_dump() if engine.backend == "vllm" else engine.fake.model_dump()
    if engine.backend == "fake" and engine.vllm.max_model_len:
        args["max_model_len"] = engine.vllm.max_model_len
    return EngineSpec(engine.backend, model.path, model.name, args)


def _start_ray(address: str | None) -> None:
    import contextlib
    import logging
    import os

    import ray
    from ray.data import DataContext

    from pipeline.observe.logs import quiet_native_stderr

    if not ray.is_initialized():
        # Ray's C++ core writes errors no user can act on to the terminal: e.g. every Ray Data actor pool makes it
        # log that the actors' constructor arguments live in the object store (ray-project/ray#53727). Fatal only;
        # the core announces that setting on stderr as it starts, so the start runs with native stderr quieted
        # (Python's own output is untouched). A level the user set is theirs, and so is its announcement.
        ours = "RAY_BACKEND_LOG_LEVEL" not in os.environ
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
        with quiet_native_stderr() if ours else contextlib.nullcontext():
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
        self.tables: list[pa.Table] = []
        self.rows = 0
        self._since = time.monotonic()

    def add(self, table: pa.Table) -> None:
        self.tables.append(table)
        self.rows += table.num_rows
        if self.rows >= self.max_rows or time.monotonic() - self._since > self.max_age_s:
            self.flush()

    def flush(self) -> None:
        if self.tables:
            rows = pa.concat_tables(self.tables, promote_options="permissive")
            failed = pc.is_valid(rows.column("error_code"))
            self.staging.write_table("results", rows.filter(pc.invert(failed)))
            self.staging.write_table("errors", rows.filter(failed))
        self.tables, self.rows = [], 0
        self._since = time.monotonic()


class _ResultSink:
    """Takes the engines' output blocks on the driver: drops re-deliveries, stages the rest, counts them.

    Works on whole Arrow blocks: a million-row job must not cost a Python object per row here."""

    def __init__(
        self, staging: StagingArea, staging_rows: int, finished: set[str], counters: JobCounters
    ) -> None:
        self.buffer = _StagingBuffer(staging, staging_rows)
        # A re-executed Ray task (lost node, lineage reconstruction) could hand back rows already seen; the
        # contract is exactly-once, so the driver keeps the ids it staged and drops repeats.
        self.staged = set(finished)
        self.counters = counters
        self.pools: dict[str, dict[str, float]] = {}
        self.duplicates_dropped = 0
        self._started = time.monotonic()

    def add(self, block: pa.Table) -> None:
        ids = block.column("custom_id").to_pylist()
        staged = self.staged
        if not staged.isdisjoint(ids) or len(set(ids)) != len(ids):
            keep = []
            for custom_id in ids:
                keep.append(custom_id not in staged)
                staged.add(custom_id)
            block = block.filter(pa.array(keep))
            self.duplicates_dropped += len(ids) - block.num_rows
        else:
            staged.update(ids)
        if not block.num_rows:
            return
        self.buffer.add(block)
        self.counters.add(
            block.num_rows,
            block.num_rows - block.column("error_code").null_count,
            _sum(block, "prompt_tokens"),
            _sum(block, "completion_tokens"),
        )
        elapsed = round(time.monotonic() - self._started, 3)
        pools = block.column("pool")
        names = pc.unique(pools).to_pylist()
        for name in names:
            rows = block if len(names) == 1 else block.filter(pc.equal(pools, name))
            stats = self.pools.setdefault(
                name, {"rows": 0, "prompt_tokens": 0, "completion_tokens": 0, "first_result_s": None}
            )
            stats["rows"] += rows.num_rows
            stats["prompt_tokens"] += _sum(rows, "prompt_tokens")
            stats["completion_tokens"] += _sum(rows, "completion_tokens")
            if stats["first_result_s"] is None:
                stats["first_result_s"] = elapsed
            stats["last_result_s"] = elapsed


def _sum(table: pa.Table, column: str) -> int:
    return int(pc.sum(table.column(column)).as_py() or 0)


# Chunk sizing for engines whose speed is known up front: each read task and actor call costs tens of ms of Ray
# Data scheduling, so a chunk should carry seconds of work; the cap bounds what one chunk holds in memory.
CHUNK_SECONDS = 2.0
MAX_CHUNK_ROWS = 16384


@dataclass(frozen=True)
class PoolPlan:
    """How one pool runs: its engine spec, the size of its work chunks and how much work its engines hold."""

    pool: PoolConfig
    spec: EngineSpec
    batch_size: int  # rows per chunk (one Ray Data batch, one actor call)
    calls_per_actor: int  # chunks each engine actor works on at once
    in_flight: int  # requests each engine actor keeps inside the engine at once
    max_engines: int

    @property
    def credit(self) -> int:
        """Rows the pool may hold at once: what its engines can work on, plus a chunk each to hide the latency."""
        return self.max_engines * self.engine_credit

    @property
    def engine_credit(self) -> int:
        return (self.calls_per_actor + 1) * self.batch_size

    def lanes(self, config: JobConfig, keyed_rows: int) -> int:
        """Engines that get a lane of their own (prefix-aware routing), or 0 to run the pool as one actor pool.

        Lanes only where they can pay: a job with shared prompts, a pool of several engines; and only for a fixed
        pool (a lane is one engine; an autoscaling pool keeps Ray Data's actor pool, which can grow)."""
        pool = self.pool
        fixed = pool.max_engines is None or pool.max_engines == pool.min_engines
        if config.routing.prefix_aware and keyed_rows and fixed and self.max_engines > 1:
            return self.max_engines
        return 0


def plan_pool(config: JobConfig, spec: EngineSpec, pool: PoolConfig) -> PoolPlan:
    spec = replace(spec, args={**spec.args, **pool.engine_overrides}, cpus=pool.cpus_per_engine)
    limit = spec.args.get("max_num_seqs") or spec.args.get("max_concurrency") or 64
    in_flight = config.engine.max_in_flight or 2 * int(limit)
    # A chunk comes back only when all its rows are done (Ray Data hands a task's output on at its end), so for a
    # real engine chunks stay small — half the in-flight window — and finished rows flow back steadily. An engine
    # that can say how fast it is gets chunks of about CHUNK_SECONDS of work instead.
    batch_size = config.resources.rows_per_task
    if batch_size is None:
        batch_size = max(1, -(-in_flight // 2))
        speed = engine_class(spec.backend).rows_per_second(spec)
        if speed:
            batch_size = int(min(MAX_CHUNK_ROWS, max(batch_size, speed * CHUNK_SECONDS)))
    # Enough overlapping chunks per actor that `in_flight` requests are always with the engine, so its
    # continuous batching stays full across chunk boundaries.
    calls_per_actor = max(2, -(-in_flight // batch_size))
    return PoolPlan(pool, spec, batch_size, calls_per_actor, in_flight, pool.max_engines or pool.min_engines)


def taker_name(pool: str, lane: int | None) -> str:
    """Whom the work queue serves: a pool, or one lane (engine) of it."""
    return pool if lane is None else f"{pool}/{lane}"


def _pool_dataset(
    plan: PoolPlan,
    queue: Any,
    monitor: Any,
    job_id: str,
    pending_rows: int,
    lane: int | None = None,
    readers_on: str | None = None,
):
    """One pool's pipeline: pull chunks from the shared queue → its engine actors.

    With `lane`, the pipeline of one engine of the pool (an actor pool of one) that pulls as its own taker, so the
    queue decides which engine runs which requests (prefix-aware routing)."""
    import ray

    from pipeline.runtime.work_queue import queue_datasource
    from pipeline.runtime.worker import EngineWorker

    pool = plan.pool
    taker = taker_name(pool.name, lane)
    engines = plan.max_engines if lane is None else 1
    # Each read task pulls one chunk; a few at a time per engine is plenty of supply, and the queue's credit (not
    # the number of readers) bounds how much work the pool holds. Every taker gets tasks enough for the whole job
    # (a lane may end up doing all of it); the ones that find the queue empty return nothing.
    tasks = max(1, -(-pending_rows // plan.batch_size))
    source = queue_datasource(queue, taker, read_tasks=tasks, chunk_rows=plan.batch_size)
    # Readers run on the driver's node (`readers_on`, a node id): a chunk leaves the queue once, so a read task lost
    # with a worker node (or its output block, re-made by lineage) would re-run and pull *another* chunk, and the
    # first one's rows would never be run. On the driver's node they share the job's fate; only engines move. Every
    # Ray node carries its id as a label, which is how Ray Data itself pins reads to a node.
    ds = ray.data.read_datasource(
        source,
        num_cpus=0,
        override_num_blocks=tasks,
        concurrency=min(tasks, 2 * engines),
        label_selector={"ray.io/node-id": readers_on} if readers_on is not None else None,
    )
    return ds.map_batches(
        EngineWorker,
        fn_constructor_kwargs={
            "spec": plan.spec,
            "pool": pool.name,
            "monitor": monitor,
            "job_id": job_id,
            "queue": queue,
            "max_in_flight": plan.in_flight,
            "taker": taker,
        },
        batch_size=plan.batch_size,
        compute=ray.data.ActorPoolStrategy(
            min_size=pool.min_engines if lane is None else 1,
            max_size=engines,
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
    keyed_rows: int = 0,
) -> EngineRun:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pipeline.runtime.monitor import JobMonitor
    from pipeline.runtime.work_queue import WorkQueue

    files = staging.pending_requests(finished)
    if not files:
        return EngineRun()
    pending_rows = staging.num_rows(files)
    # Engine counts and CPUs the job left open are decided against the cluster Ray now sees; never more engines
    # than there are chunks to give them (a chunk's size does not depend on how many engines there are).
    engines_given = bool(config.pools) or config.resources.num_engines is not None
    pools = [
        place_pool(pool, spec, engines_given, -(-pending_rows // plan_pool(config, spec, pool).batch_size))
        for pool in effective_pools(config)
    ]
    # The monitor and the queue are pinned to the driver's node: they must not go down with a worker node (that
    # is what they help survive), and the queue reads the staged work list where the driver wrote it (a local
    # staging directory is on this node's disk).
    # The monitor is named so operators (and tests) can find a job's engines: ray.get_actor(name).snapshot().
    node_id = ray.get_runtime_context().get_node_id()
    here = NodeAffinitySchedulingStrategy(node_id, soft=False)
    monitor = (
        ray.remote(num_cpus=0)(JobMonitor)
        .options(name=f"nightshift-monitor-{job_id}", scheduling_strategy=here)
        .remote()
    )
    plans = [plan_pool(config, spec, pool) for pool in pools]
    # Who pulls from the queue: each pool as a whole, or each of its engines as a lane of its own.
    takers = [(plan, lane) for plan in plans for lane in range(plan.lanes(config, keyed_rows)) or [None]]
    credit = {
        taker_name(plan.pool.name, lane): plan.credit if lane is None else plan.engine_credit
        for plan, lane in takers
    }
    route = any(lane is not None for _, lane in takers)
    # The queue looks ahead by what all engines hold at once, a few times over, to find rows of each engine's
    # prompts; bounded, since a million-row job must not be read into memory.
    window = min(65536, max(8192, 4 * sum(credit.values())))
    queue = (
        ray.remote(num_cpus=0)(WorkQueue)
        .options(scheduling_strategy=here)
        .remote(files, credit, files_on=staging.files, route=route, window_rows=window)
    )
    datasets = [
        _pool_dataset(plan, queue, monitor, job_id, pending_rows, lane, readers_on=node_id)
        for plan, lane in takers
    ]
    ds = datasets[0].union(*datasets[1:]) if len(datasets) > 1 else datasets[0]

    sink = _ResultSink(staging, config.output_options.staging_rows, finished, counters)
    # Live engine numbers (KV usage, preemptions, prefix hits) in the display and logs; warns once on preemptions.
    watch = EngineWatch.of_monitor(monitor, staging.read_job().get("fit"))
    with ProgressDisplay(counters, enabled=show_progress, engines=watch.poll) as progress:
        for block in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            sink.add(block)
            progress.update(pools=sink.pools)
        sink.buffer.flush()
        progress.update(force=True, pools=sink.pools)
    run = EngineRun(pools=sink.pools, duplicates_dropped=sink.duplicates_dropped)
    reserved = {pool.name: pool.cpus_per_engine for pool in pools}
    for name, stats in run.pools.items():
        stats["cpus_per_engine"] = reserved.get(name) or 0.0
        stats["engines"] = sum(
            1 for info in ray.get(monitor.snapshot.remote()).values() if info["pool"] == name
        )
        span = stats.get("last_result_s") or 0
        stats["output_tokens_per_s"] = round(stats["completion_tokens"] / span, 2) if span else 0.0
    run.snapshot = ray.get(monitor.snapshot.remote())
    run.retried_requests = len(ray.get(monitor.retries.remote()))
    run.recovery = summarize_recovery(ray.get(monitor.work.remote()))
    run.preemption_warned = watch.warned
    queued = ray.get(queue.stats.remote())
    # Routing facts: rows each lane ran; "rows_routed" ran on their key's owner, "rows_stolen" on another engine
    # (so that none idled), "rows_unkeyed" had no shared prompt; "keys": prompts that got an owning lane.
    run.routing = {
        "enabled": config.routing.prefix_aware,
        "lanes_used": route,
        "keyed_rows_in_input": keyed_rows,
        "rows_by_lane": dict(sorted(queued["served_by"].items())) if route else {},
        **queued["routing"],
    }
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
    for unused in config.engine.unused_settings():
        log.warning(unused)
    job_id = state["job_id"]

    staging.create()

    def prepare_work() -> JobConfig:
        if not state.get("ingested"):
            # A validation pass cut short is redone whole: it is cheap next to generation, and partial parts of it
            # could otherwise be staged twice.
            staging.discard_ingest()
            state["model"] = model.model_dump()
            staging.write_job(state)
            # Validated and measured by tasks on the cluster; too-long prompts are error records already.
            report = ingest(
                source,
                model.name,
                staging,
                job_id=job_id,
                limits=config.limits,
                measure=measuring(config, model),
            )
            state["input"] = {
                "location": source.describe(),
                "fingerprint": report.fingerprint,
                "size_bytes": report.size_bytes,
                "lines": report.lines,
                "valid": report.valid,
                "invalid": report.invalid,
                "prefix_keyed": report.keyed,
            }
            if report.lengths is not None:
                state["lengths"] = report.lengths.to_dict()
            state["ingest"] = {
                "nodes": report.nodes(),
                "tasks_by_node": report.placement,
                "seconds": {step: round(s, 3) for step, s in report.seconds.items()},
                "range_bytes": report.range_bytes,
            }
            state["ingested"] = True
            staging.write_job(state)
        # Engine args fitted to the measured aggregate (runtime/fit.py; kept in state).
        return fit_job(config, model, staging, state)

    # Ingest runs as tasks on the cluster, so Ray starts first.
    _start_ray(config.resources.address)
    config = prepare_work()
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
        keyed = state["input"].get("prefix_keyed", 0)
        run = _run_engines(config, spec, staging, counters, show_progress, job_id, finished, keyed)

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
        "ingest": state.get("ingest"),  # where validation ran (Ray node ids), per step
        "model": model.model_dump(),
        "engine": {
            "backend": spec.backend,
            "args": engines.get("effective_args") or spec.args,
            "sampling_defaults": engines.get("sampling_defaults", {}),
            "engines": engines.get("engines", 0),
            "kv_cache_tokens_per_engine": engines.get("kv_cache_tokens_per_engine"),
            "kv_cache_usage_peak": engines.get("kv_cache_usage_peak"),
            "cpu_cores": engines.get("cpu_cores") or None,
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
        "routing": run.routing,
        "recovery": {
            "resumed": bool(resume),
            "rows_from_earlier_runs": len(finished),
            "requests_retried_after_engine_failure": run.retried_requests,
            "duplicate_deliveries_dropped": run.duplicates_dropped,
            **run.recovery,
        },
        "pools": run.pools,
        "storage": RetryStats.since(retries_before),
    }
    commit(output, staging, manifest)
    return JobOutcome(output.where, manifest, counters, run.pools)


def _iso(epoch: float | None) -> str | None:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).isoformat() if epoch else None


def load_resumable(output: str, storage: dict[str, Any] | None = None) -> JobConfig:
    """The job spec stored in OUTPUT/_staging/job.json, for `nightshift resume OUTPUT`.

    `storage`: StorageConfig fields given on this machine's command line (e.g. the S3 endpoint), needed to reach
    OUTPUT before its stored spec can be read; they win over the stored ones.
    """
    given = {k: v for k, v in (storage or {}).items() if v is not None}
    reach = StorageConfig(**given)
    staging = output_target(output, reach).staging_area()
    try:
        if not staging.exists():
            raise PreflightError(f"{output} holds no unfinished job (no _staging/): nothing to resume")
        state = staging.read_job()
    except PreflightError:
        raise
    except FileNotFoundError as exc:
        raise PreflightError(str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - an unreachable or denied OUTPUT: say what to change
        raise PreflightError(output_problem(exc, output, reach, "resume from")) from exc
    config = JobConfig.model_validate(state["config"])
    config = merge_overrides(config, {f"storage.{k}": v for k, v in given.items()})
    return config.model_copy(update={"output": output, "job_id": state["job_id"]})
