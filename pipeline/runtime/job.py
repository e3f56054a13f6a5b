"""One batch job, end to end: preflight → ingest → fit → engines (Ray Data actor pool) → stage → finalize.

    read ─▶ validate ─▶ fit ─▶ (resume filter) ─▶ engine actors ─▶ stage ─▶ finalize

The driver streams: it validates the input into staging (while Ray starts), fits the engine args to it, hands Ray
Data the staged work list, and writes
finished rows back into staging as they arrive. Nothing here holds the whole input or output in memory.
Staging is the checkpoint: a job interrupted at any point is continued by `resume`, which re-runs only the
requests that have no staged row yet.
"""

from __future__ import annotations

import datetime as dt
import resource
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from pipeline import __version__
from pipeline.config import (
    DEFAULT_MAX_NUM_SEQS,
    JobConfig,
    PoolConfig,
    StorageConfig,
    effective_pools,
    merge_overrides,
)
from pipeline.engines.base import EngineSpec, engine_class
from pipeline.io.locations import RetryStats
from pipeline.io.readers import InputSource
from pipeline.io.staging import StagingArea
from pipeline.io.writers import OutputTarget, output_target
from pipeline.models import ResolvedModel, resolve_model
from pipeline.observe.progress import JobCounters, ProgressDisplay
from pipeline.runtime.finalize import FORMAT_VERSION, commit, write_outputs
from pipeline.runtime.fit import fit_job
from pipeline.runtime.ingest import ingest
from pipeline.runtime.monitor import EngineWatch, preemption_remedy, summarize_engines, summarize_recovery
from pipeline.runtime.placement import place_pool
from pipeline.runtime.preflight import (
    PreflightError,
    check_input_source,
    check_output_target,
    output_problem,
)
from pipeline.runtime.sink import ChunkSink

log = structlog.get_logger(__name__)

PROGRESS_POLL_S = 0.5  # how often the driver reads the queue's totals (one small actor call)


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
    leases: dict[str, int] = field(default_factory=dict)  # chunks handed out, and handed out again
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


class _InBackground:
    """Run a function on a daemon thread (a Ctrl-C must not wait for it); `result()` joins and re-raises."""

    def __init__(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None

        def target() -> None:
            try:
                self._value = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller by result()
                self._error = exc

        self._thread = threading.Thread(
            target=target, name=getattr(fn, "__name__", "background"), daemon=True
        )
        self._thread.start()

    def wait(self, timeout: float) -> bool:
        """Whether it has finished, waiting at most `timeout` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


# Chunk sizing for engines whose speed is known up front: each lease and acknowledgement costs a few actor calls,
# so a chunk should carry seconds of work; the cap bounds what one chunk holds in memory.
CHUNK_SECONDS = 2.0
MAX_CHUNK_ROWS = 16384


@dataclass(frozen=True)
class PoolPlan:
    """How one pool runs: its engine spec, the size of its chunks and how many requests its engines hold."""

    pool: PoolConfig
    spec: EngineSpec
    chunk_rows: int  # rows per lease
    in_flight: (
        int | None
    )  # requests each engine keeps inside it; None: 2 x its own max_num_seqs, once started
    max_engines: int


def plan_pool(config: JobConfig, spec: EngineSpec, pool: PoolConfig) -> PoolPlan:
    spec = replace(spec, args={**spec.args, **pool.engine_overrides}, cpus=pool.cpus_per_engine)
    known = spec.args.get("max_num_seqs") or spec.args.get("max_concurrency")
    in_flight = config.engine.max_in_flight or (2 * int(known) if known else None)
    # A chunk's rows are staged when all of them are done, so for a real engine chunks stay small — half the
    # in-flight window — and finished rows reach staging steadily. An engine that can say how fast it is gets
    # chunks of about CHUNK_SECONDS of work instead. (With max_num_seqs left to the engine, vLLM's usual
    # default sizes the chunk; the window itself follows the engine's value.)
    chunk_rows = config.resources.rows_per_task
    if chunk_rows is None:
        chunk_rows = max(1, (in_flight or 2 * DEFAULT_MAX_NUM_SEQS) // 2)
        speed = engine_class(spec.backend).rows_per_second(spec)
        if speed:
            chunk_rows = int(min(MAX_CHUNK_ROWS, max(chunk_rows, speed * CHUNK_SECONDS)))
    return PoolPlan(pool, spec, chunk_rows, in_flight, pool.max_engines or pool.min_engines)


def _pool_dataset(
    plan: PoolPlan, queue: Any, monitor: Any, sink: ChunkSink, job_id: str, max_in_flight: int | None
):
    """One pool's pipeline: a ticket per engine → its engine actors, which lease chunks from the shared queue.

    Ray Data does what it does well — placing the actors by resources and accelerator type, scaling the pool,
    restarting a dead actor and re-running its ticket; the queue adds what it lacks: leases that come back when
    their engine dies, prefix-aware routing, and pulling across pools (a faster pool simply leases more)."""
    import ray

    from pipeline.runtime.worker import EngineWorker

    pool = plan.pool
    tickets = [{"ticket": f"{pool.name}/{i}"} for i in range(plan.max_engines)]
    ds = ray.data.from_items(tickets, override_num_blocks=len(tickets))
    return ds.map_batches(
        EngineWorker,
        fn_constructor_kwargs={
            "spec": plan.spec,
            "pool": pool.name,
            "monitor": monitor,
            "job_id": job_id,
            "queue": queue,
            "sink": sink,
            "chunk_rows": plan.chunk_rows,
            "max_in_flight": max_in_flight,
        },
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(
            min_size=pool.min_engines, max_size=plan.max_engines, max_concurrent_calls_per_actor=1
        ),
        num_cpus=pool.cpus_per_engine,
        num_gpus=pool.gpus_per_engine or None,
        resources=pool.resources_per_engine or None,
        accelerator_type=pool.accelerator_type,
        batch_format="numpy",
    )


def _wait_for_earlier_driver(job_id: str, timeout_s: float = 120.0) -> None:
    """On a long-lived cluster, the engines of a driver that died a moment ago may still be staging their last
    chunks until Ray reaps them (they share their driver's fate). Pending work is listed only once they are gone,
    or it would include rows they are about to stage. Their job monitor's name tells whether any are left."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get_actor(f"nightshift-monitor-{job_id}")
        except ValueError:
            return
        if time.monotonic() > deadline:
            raise PreflightError(
                f"job {job_id} is still running from another driver on this cluster; stop it before resuming"
            )
        time.sleep(0.5)


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
    from pipeline.runtime.sink import PartWriter, engines_share_disk_with_driver
    from pipeline.runtime.work_queue import WorkQueue

    _wait_for_earlier_driver(job_id)
    files = staging.pending_requests(finished)
    if not files:
        return EngineRun()
    pending_rows = staging.num_rows(files)
    # Engine counts and CPUs the job left open are decided against the cluster Ray now sees; never more engines
    # than there are chunks to give them (a chunk's size does not depend on how many engines there are).
    engines_given = bool(config.pools) or config.resources.num_engines is not None
    pools = [
        place_pool(pool, spec, engines_given, -(-pending_rows // plan_pool(config, spec, pool).chunk_rows))
        for pool in effective_pools(config)
    ]
    # The monitor, the queue and (for a local OUTPUT on a multi-host cluster) the part writer are pinned to the
    # driver's node: they must not go down with a worker node (that is what they help survive), and a local
    # staging directory is on this node's disk.
    # The monitor is named so operators (and tests) can find a job's engines: ray.get_actor(name).snapshot().
    node_id = ray.get_runtime_context().get_node_id()
    here = NodeAffinitySchedulingStrategy(node_id, soft=False)
    monitor = (
        ray.remote(num_cpus=0)(JobMonitor)
        .options(name=f"nightshift-monitor-{job_id}", scheduling_strategy=here)
        .remote()
    )
    plans = [plan_pool(config, spec, pool) for pool in pools]
    route = config.routing.prefix_aware and keyed_rows > 0 and sum(p.max_engines for p in plans) > 1
    # The queue looks ahead a few chunks per engine to find rows of each engine's prompts; bounded, since a
    # million-row job must not be read into memory.
    window = min(65536, max(8192, 4 * sum(p.max_engines * p.chunk_rows for p in plans)))
    queue = (
        ray.remote(num_cpus=0)(WorkQueue)
        .options(scheduling_strategy=here)
        .remote(files, files_on=staging.files, route=route, window_rows=window, run_id=uuid.uuid4().hex[:8])
    )
    writer = None
    if not engines_share_disk_with_driver(staging.is_local):
        writer = ray.remote(num_cpus=0)(PartWriter).options(scheduling_strategy=here).remote(staging)
    sink = ChunkSink(staging, writer)
    datasets = [
        _pool_dataset(plan, queue, monitor, sink, job_id, config.engine.max_in_flight) for plan in plans
    ]
    ds = datasets[0].union(*datasets[1:]) if len(datasets) > 1 else datasets[0]

    # Live engine numbers (KV usage, preemptions, prefix hits) in the display and logs; warns once on preemptions.
    watch = EngineWatch.of_monitor(monitor, staging.read_job().get("fit"))
    seen = {"rows": 0, "failed": 0, "prompt_tokens": 0, "completion_tokens": 0}
    progress_pools: dict[str, dict[str, Any]] = {}

    def take_progress() -> None:
        latest = ray.get(queue.progress.remote())
        delta = {key: latest[key] - seen[key] for key in seen}
        if delta["rows"]:
            counters.add(delta["rows"], delta["failed"], delta["prompt_tokens"], delta["completion_tokens"])
            seen.update({key: latest[key] for key in seen})
        progress_pools.clear()
        progress_pools.update(latest["pools"])

    # The engines run in Ray; the driver only watches: acknowledgements are counted by the queue.
    running = _InBackground(lambda: sum(int(b["chunks"].sum()) for b in ds.iter_batches(batch_size=None)))
    with ProgressDisplay(counters, enabled=show_progress, engines=watch.poll) as progress:
        while not running.wait(PROGRESS_POLL_S):
            take_progress()
            progress.update(pools=progress_pools)
        running.result()
        take_progress()
        progress.update(force=True, pools=progress_pools)
    run = EngineRun(pools={name: dict(stats) for name, stats in progress_pools.items()})
    reserved = {pool.name: pool.cpus_per_engine for pool in pools}
    snapshot = ray.get(monitor.snapshot.remote())
    for name, stats in run.pools.items():
        stats["cpus_per_engine"] = reserved.get(name) or 0.0
        stats["engines"] = sum(1 for info in snapshot.values() if info["pool"] == name)
        span = stats.get("last_result_s") or 0
        stats["output_tokens_per_s"] = round(stats["completion_tokens"] / span, 2) if span else 0.0
    run.snapshot = snapshot
    run.retried_requests = len(ray.get(monitor.retries.remote()))
    run.recovery = summarize_recovery(ray.get(monitor.work.remote()))
    run.preemption_warned = watch.warned
    queued = ray.get(queue.stats.remote())
    run.duplicates_dropped = queued["duplicate_acks"]
    run.leases = {
        k: queued[k] for k in ("chunks_issued", "chunks_reissued", "rows_reissued", "duplicate_acks")
    }
    # Routing facts: rows each engine ran; "rows_routed" ran on their key's owner, "rows_stolen" on another
    # engine (so that none idled), "rows_unkeyed" had no shared prompt; "keys": prompts that got an owning engine.
    run.routing = {
        "enabled": config.routing.prefix_aware,
        "used": route,
        "keyed_rows_in_input": keyed_rows,
        "rows_by_engine": dict(sorted(queued["served_by"].items())) if route else {},
        **queued["routing"],
    }
    for actor in (monitor, queue, writer):
        if actor is not None:
            ray.kill(actor)
    if run.duplicates_dropped:
        log.warning(
            "dropped chunks that ran twice (their engine died after staging them)",
            chunks=run.duplicates_dropped,
        )
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
    cpu0 = time.process_time()
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
            report = ingest(source, model.name, staging, job_id=job_id, limits=config.limits)
            state["input"] = {
                "location": source.describe(),
                "fingerprint": report.fingerprint,
                "size_bytes": report.size_bytes,
                "lines": report.lines,
                "valid": report.valid,
                "invalid": report.invalid,
                "prefix_keyed": report.keyed,
            }
            state["ingested"] = True
            staging.write_job(state)
        # Engine args fitted to the data, too-long prompts failed before any engine (runtime/fit.py; kept in state).
        return fit_job(config, model, staging, state)

    # Ray's start-up (seconds of process launches, mostly waiting) overlaps validation and fitting instead of
    # following them; engines are needed unless every row is invalid or already finished, which is rare.
    preparing = _InBackground(prepare_work)
    try:
        _start_ray(config.resources.address)
    finally:
        config = preparing.result()
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
        "model": model.model_dump(),
        "engine": {
            "backend": spec.backend,
            "args": engines.get("effective_args") or spec.args,
            "sampling_defaults": engines.get("sampling_defaults", {}),
            "engines": engines.get("engines", 0),
            "kv_cache_tokens_per_engine": engines.get("kv_cache_tokens_per_engine"),
            "in_flight": engines.get("in_flight"),
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
            "leases": run.leases,
            **run.recovery,
        },
        "pools": run.pools,
        "storage": RetryStats.since(retries_before),
        # What coordinating cost this process (all its threads): the cluster does the per-row work, so this
        # should grow with files, chunks and shards, not with rows.
        "driver": {
            "cpu_s": round(time.process_time() - cpu0, 3),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        },
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
