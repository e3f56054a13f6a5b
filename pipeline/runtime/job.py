"""One batch job, end to end — the order of the steps; each step lives in its own module:

    preflight ─▶ ingest ─▶ fit ─▶ (resume filter) ─▶ engines ─▶ stage ─▶ commit
                 └── engine actors start, load and wait for the fitted args ──┘
                     (or, fitted early to a sample, take requests while ingest reads: streaming)

    runtime/preflight.py           input and output reachable and usable, before any work
    runtime/hosting/session.py             the Ray session (a private instance, or a cluster's address)
    runtime/ingest/tasks.py        read + validate + measure as tasks on the cluster: the work list, first errors
    runtime/ingest/measure.py      requests measured as fitting counts them (in the ingest tasks)
    runtime/ingest/sample.py       a sample spread over the input, measured first: what the early fit decides from
    runtime/ingest/fit.py          engine args fitted to the measured requests (on the driver)
    runtime/engines/launch.py      pools of engine actors (engine_actor.py) leasing chunks from the work queue
    runtime/engines/sink.py          engines stage their own results; only acknowledgements reach the queue
    runtime/commit/finalize.py     sorted, sharded output, then the manifest, written last
    runtime/hosting/executor.py            how ingest's and finalize's tasks run: Ray tasks, or in this process

`run_job` is that order and nothing else: each step is a function below it, sharing the run's `_Job`.

Staging is the checkpoint: a job interrupted at any point is continued by `resume`, which re-runs only the
requests that have no staged row yet.
"""

from __future__ import annotations

import datetime as dt
import resource
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from pipeline import __version__
from pipeline.config import JobConfig, StorageConfig, merge_overrides
from pipeline.datasets.render import DatasetError
from pipeline.engines.base import EngineSpec, engine_class
from pipeline.fit_record import FitDecision, decision_of
from pipeline.io.locations import RetryStats
from pipeline.io.readers import InputSource
from pipeline.io.staging import JobStateError, StagingArea
from pipeline.io.writers import OutputTarget, output_target
from pipeline.job_plan import JobPlan, JobPlanError
from pipeline.manifest import (
    Cost,
    DriverCost,
    EngineReport,
    Manifest,
    Placement,
    Recovery,
    StorageRetries,
    Throughput,
)
from pipeline.models import ResolvedModel
from pipeline.observe.cost import job_cost
from pipeline.observe.progress import JobCounters
from pipeline.observe.recorder import JobRecorder
from pipeline.observe.report import request_usage, write_report
from pipeline.prices import check_pools, parse_hosted_price
from pipeline.runtime.commit.finalize import FORMAT_VERSION, FinalizeOutputs, commit, write_outputs
from pipeline.runtime.commit.pending import PendingWork, pending_work
from pipeline.runtime.engines.launch import (
    EngineLaunch,
    EngineRun,
    feed_spec,
    merged_runs,
    models_summary,
    pool_spec,
)
from pipeline.runtime.engines.monitor import EngineSummary, preemption_remedy, summarize_engines
from pipeline.runtime.engines.warm_keeper import NAMESPACE
from pipeline.runtime.hosting.executor import use_task_hosts
from pipeline.runtime.hosting.session import start_ray
from pipeline.runtime.hosting.task_hosts import find_task_hosts
from pipeline.runtime.ingest.fit import (
    apply_fit,
    decide,
    decide_early,
    fit_job,
    hold_above,
    nothing_to_fit,
    settle_early_fit,
)
from pipeline.runtime.ingest.measure import measuring
from pipeline.runtime.ingest.sample import Sample
from pipeline.runtime.ingest.tasks import held_requests, ingest, sample_input, settle_losers
from pipeline.runtime.preflight import (
    PreflightError,
    check_input_source,
    check_output_target,
    output_problem,
)
from pipeline.state import IngestRecord, JobInput, JobState
from pipeline.topology import Topology, check_pool_resources

log = structlog.get_logger(__name__)


@dataclass
class JobOutcome:
    output: Path | str  # a local directory, or the s3:// / http(s):// URL
    manifest: dict[str, Any]  # manifest.json as written
    counters: JobCounters
    pools: dict[str, dict[str, float]] = field(default_factory=dict)


def _prepare(
    config: JobConfig, plan: JobPlan, resume: bool
) -> tuple[InputSource, OutputTarget, StagingArea, JobState]:
    """Preflight, then either a fresh job spec or the stored one of the job being resumed."""
    # A dataset job reads a table: no request-line schema is asked of it (its columns are checked in _open_job).
    source = check_input_source(config.input, config.storage, plan.table_read)
    output = check_output_target(config.output, config.overwrite, config.storage, resume=resume)
    staging = output.staging_area()
    if resume and staging.exists():
        state = staging.read_job()
        stored = state.input.fingerprint if state.input else None
        if stored:
            current = source.fingerprint()
            if current != stored:
                raise PreflightError(
                    f"input {config.input} changed since the job started ({stored} → {current}); resuming would "
                    "mix two inputs. Restore the original input, or start a new job in another OUTPUT."
                )
        log.info("resuming job", job_id=state.job_id, output=str(output))
        return source, output, staging, state
    if resume:
        raise PreflightError(
            f"output {config.output} holds no unfinished job (no _staging/): nothing to resume"
        )
    state = JobState(job_id=config.job_id or uuid.uuid4().hex[:16], config=config)
    return source, output, staging, state


def run_job(config: JobConfig, show_progress: bool = True, resume: bool = False) -> JobOutcome:
    """Run (or, with resume=True, continue) one job; returns when the output is committed."""
    clock = _RunClock.start()
    job = _open_job(config, resume)
    try:
        job.staging.create()
        job.recorder.run_started()
        # Ingest runs as tasks on the cluster, so Ray starts first.
        start_ray(config.resources.address, keep_idle_workers=True)
        _use_warm_task_hosts(config)
        engines = _start_engines(job)
        try:
            _ingest(job, engines)
            fitted = _fit(job, engines)
            counters = _validated_counters(job.state)
            run, work = _run_engines(job, engines, fitted, counters, show_progress)
        except BaseException:
            engines.abort()
            raise
        manifest = _finalize(job, engines, fitted, run, work, counters, clock)
        commit(job.output, job.staging, manifest)
        return JobOutcome(job.output.where, manifest.model_dump(mode="json"), counters, run.pools)
    finally:
        use_task_hosts([])
        job.recorder.close()


def _use_warm_task_hosts(config: JobConfig) -> None:
    """On warm engines whose runtime keeps task hosts (`nightshift up`), this job's tasks run there: no fresh worker
    imports the tokenizer's libraries and loads the tokenizer again (runtime/hosting/task_hosts.py)."""
    hosts = find_task_hosts(config.engine.warm_engines, NAMESPACE) if config.engine.warm_engines else []
    use_task_hosts(hosts)
    if hosts:
        log.info("tasks run on the warm runtime's task hosts", hosts=len(hosts))


# --- the steps of run_job --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RunClock:
    """When this run began, by the wall clock, the monotonic clock and this process's CPU time, and the storage
    retries counted before it: the manifest reports the run's share of each."""

    started_at: dt.datetime
    t0: float
    cpu0: float
    retries_before: dict[str, Any]

    @classmethod
    def start(cls) -> _RunClock:
        return cls(
            dt.datetime.now(dt.timezone.utc), time.monotonic(), time.process_time(), RetryStats.snapshot()
        )


@dataclass
class _Job:
    """One run of a job, as its steps share it: where it reads and writes, its state, its plan, its recorder."""

    plan: JobPlan  # resolved, as given: fitting makes the plan the engines run (`_fit`)
    resume: bool
    source: InputSource
    output: OutputTarget
    staging: StagingArea
    state: JobState
    recorder: JobRecorder

    @property
    def config(self) -> JobConfig:
        return self.plan.config

    @property
    def model(self) -> ResolvedModel:
        return self.plan.model

    @property
    def job_id(self) -> str:
        return self.state.job_id


def _open_job(config: JobConfig, resume: bool) -> _Job:
    """Preflight: input and output checked, the job's state (fresh or stored), its plan resolved (models, an http
    job's servers probed), its engines and backend checked, and its recorder started — everything that can refuse
    the job before any work."""
    try:
        # Adapter names that clash, and templates that do not compile, are refused here, before any work.
        plan = JobPlan.of(config)
        source, output, staging, state = _prepare(config, plan, resume)
        plan = plan.resolve()
    except JobPlanError as exc:
        raise PreflightError(str(exc)) from exc
    if plan.dataset is not None:
        try:
            plan.dataset.check_table(source)
        except DatasetError as exc:
            raise PreflightError(f"input {config.input}: {exc}") from exc
    for server in plan.probed.get("servers") or []:
        log.info("server", endpoint=server["endpoint"], kind=server["kind"], version=server["version"])
        for warning in server["warnings"]:
            log.warning(warning)
    spec = plan.engine_spec()
    _check_engines(plan, spec)
    for unused in config.engine.unused_settings():
        log.warning(unused)
    try:
        check_pools(config.observe.gpu_hour_price, [pool.name for pool in plan.pools])
    except ValueError as exc:
        raise PreflightError(str(exc)) from exc
    recorder = _start_recorder(config, staging, state.job_id, plan.model, spec.backend)
    return _Job(plan, resume, source, output, staging, state, recorder)


def _check_engines(plan: JobPlan, spec: EngineSpec) -> None:
    """Each pool's engine as it will start — its model, the job's engine args under the pool's overrides — checked
    by its backend, and its topology against the pool's resources (raises ValueError saying what to change)."""
    engine = engine_class(spec.backend)
    for planned in plan.pools:
        pool = planned.config
        pool_engine = feed_spec(pool_spec(spec, planned.model, None, pool), pool)
        engine.check_spec(pool_engine)
        if engine.reads_adapter_files:
            from pipeline.io.adapter_files import check_adapters

            check_adapters(pool_engine.args, plan.config.storage)
        check_pool_resources(
            pool.name,
            Topology.of(pool_engine.args),
            pool.gpus_per_engine,
            pool.cpus_per_engine,
            engine.computes_on_cpu_cores,
        )


def _start_recorder(
    config: JobConfig, staging: StagingArea, job_id: str, model: ResolvedModel, backend_name: str
) -> JobRecorder:
    """The job's timeline (kept in staging) and, with --metrics-port, its /metrics: started before any work, so a
    port already taken stops the job here with what to change."""
    recorder = JobRecorder.for_staging(
        staging, {"job_id": job_id, "model": model.name, "backend": backend_name}
    )
    recorder.charts_wanted = config.observe.report
    if config.observe.metrics_port is not None:
        try:
            port = recorder.serve_metrics(config.observe.metrics_port)
        except OSError as exc:
            raise PreflightError(
                f"--metrics-port {config.observe.metrics_port}: cannot serve metrics there ({exc.strerror or exc}); "
                "choose a free port"
            ) from exc
        log.info("metrics", url=f"http://0.0.0.0:{port}/metrics")
    return recorder


@dataclass
class _Engines:
    """The job's engine actors, once started (runtime/engines/launch.py), and whether they take requests while
    ingest still reads them (streaming)."""

    launch: EngineLaunch | None = None
    streaming: bool = False
    handed_over_at: float | None = None  # when ingest handed them their first requests (streaming)
    # Early fit: the args the engines started on, fitted to a sample of the input, and the sample.
    early: FitDecision | None = None
    sample: Sample | None = None

    @property
    def hold_above(self) -> int | None:
        """Requests needing more tokens than the early fit's context wait for the whole input's fit."""
        return hold_above(self.early) if self.early is not None else None

    def hand_over(self, parts: list[str]) -> None:
        """Streaming: more of the work list is staged."""
        assert self.launch is not None
        self.launch.add_work(parts)
        if self.handed_over_at is None:
            self.handed_over_at = time.time()

    def abort(self) -> None:
        if self.launch is not None:
            self.launch.abort()


def _start_engines(job: _Job) -> _Engines:
    """On a fresh job the engines start right away: their processes and imports overlap ingest and fitting, and
    they wait for the fitted args. When nothing is fitted to the input, or the input is larger than a sample of it
    (early fit, `_fit_early`), they take requests while ingest still reads the rest (streaming). A job ingested
    before starts them only if work is left (`_run_engines`)."""
    engines = _Engines()
    if job.state.ingested:
        return engines
    job.recorder.stage_started("engines")  # they start now, overlapping ingest and fitting
    engines.launch = EngineLaunch(job.plan, job.staging, job.job_id, job.source.rows_at_most())
    if not job.resume and engines.launch.can_stream and nothing_to_fit(job.plan):
        engines.launch.stream(apply_fit(job.plan, None))
        engines.streaming = True
    elif not job.resume and engines.launch.can_stream:
        _fit_early(job, engines)
    return engines


def _fit_early(job: _Job, engines: _Engines) -> None:
    """Early fit: a sample spread over the input is measured (runtime/ingest/sample.py) and the engines stream on
    args fitted to it, so they take requests from the first seconds however large the input. Not for an input
    under `engine.fit.early_min_bytes`, or one the sample read whole: the exact fit is then as quick."""
    config = job.config
    measure = measuring(config, job.model)
    if not config.engine.fit.early or measure is None or engines.launch is None:
        return
    size = job.source.size_bytes
    if size is not None and size < config.engine.fit.early_min_bytes:
        return
    if config.engine.warm_engines:
        # Warm engines are handed out by their fitted plan; a held request's second plan is not asked of a keeper.
        log.info("engine args fitted to the whole input first: the job runs on warm engines")
        return
    sample = sample_input(
        job.source,
        job.plan.validation_map(),
        job.staging,
        measure,
        job.job_id,
        reserve_cpus=False,
        dataset=job.plan.dataset_spec,
    )
    if sample.whole:
        return
    early = decide_early(job.plan, job.staging, job.job_id, sample)
    if early is None:
        log.info("engine args not fitted early: the sample measured no request", sampled_lines=sample.lines)
        return
    log.info("sampled the input", lines=sample.lines, seconds=round(sample.seconds, 2))
    why = f"args fitted to a sample of {sample.lines:,} lines; longer requests wait for the whole input's fit"
    engines.launch.stream(apply_fit(job.plan, early), early, why)
    engines.streaming, engines.early, engines.sample = True, early, sample


def _ingest(job: _Job, engines: _Engines) -> None:
    """Read, validate and measure the input as tasks on the cluster (runtime/ingest/tasks.py): the work list and the
    first error records staged, the state written. Done once: a job ingested before goes on from its state."""
    state, staging, recorder = job.state, job.staging, job.recorder
    if state.ingested:
        return
    # A validation pass cut short is redone whole: it is cheap next to generation, and partial parts of it could
    # otherwise be staged twice.
    staging.discard_ingest()
    recorder.stage_started("ingest")
    state.model = job.model
    staging.write_job(state)
    # Each line goes to a model some pool serves (model_not_found otherwise); the model's task rejects a route it
    # cannot serve at validation (unsupported_task), before any engine.
    served = job.plan.served
    # Validated and measured by tasks on the cluster; too-long prompts are error records already.
    report = ingest(
        job.source,
        served.validation_map(),
        staging,
        job_id=job.job_id,
        limits=job.config.limits,
        measure=measuring(job.config, job.model),
        reserve_cpus=engines.launch is None,
        on_requests=engines.hand_over if engines.streaming else None,
        adapters=frozenset(served.adapters),
        hold_above=engines.hold_above,
        dataset=job.plan.dataset_spec,
    )
    state.input = JobInput(
        location=job.source.describe(),
        fingerprint=report.fingerprint,
        size_bytes=report.size_bytes,
        lines=report.lines,
        valid=report.valid,
        invalid=report.invalid,
        prefix_keyed=report.keyed,
    )
    if report.lengths is not None:
        state.lengths = report.lengths
    state.ingest = IngestRecord(
        nodes=report.nodes(),
        tasks_by_node=report.placement,
        seconds={step: round(s, 3) for step, s in report.seconds.items()},
        range_bytes=report.range_bytes,
        streamed=engines.streaming,
        finished_at=time.time(),
        tokenizer_loads=report.tokenizer_loads,
        first_work_handed_over_at=engines.handed_over_at,
    )
    state.ingested = True
    staging.write_job(state)
    recorder.stage_ended("ingest")


def _fit(job: _Job, engines: _Engines) -> JobPlan:
    """The plan the engines run: engine args fitted to the measured aggregate (runtime/ingest/fit.py), decided
    once and kept in the state. After an early fit, what the engines ran and what the held requests run on."""
    job.recorder.stage_started("fit")
    state = job.state
    if engines.early is not None and engines.sample is not None and state.fit is None:
        full = decide(job.plan, job.staging, job.job_id, state.lengths)
        held = job.staging.num_rows(held_requests(job.staging))
        state.fit = settle_early_fit(engines.early, full, engines.sample, held)
        job.staging.write_job(state)
    fitted = fit_job(job.plan, job.staging, state)
    job.recorder.stage_ended("fit")
    return fitted


def _validated_counters(state: JobState) -> JobCounters:
    """The job's progress counters, starting from what ingest found: every line, the invalid ones done."""
    log.info("input validated", lines=state.input.lines, valid=state.input.valid, invalid=state.input.invalid)
    counters = JobCounters(total=state.input.lines)
    counters.add_invalid(state.input.invalid)
    return counters


def _run_engines(
    job: _Job, engines: _Engines, fitted: JobPlan, counters: JobCounters, show_progress: bool
) -> tuple[EngineRun, PendingWork]:
    """The engines run the work list still to run (`fitted`: the plan fitting settled); returns what they report
    and the work they were given (on resume, without what engines staged before: runtime/commit/pending.py)."""
    state, staging, recorder = job.state, job.staging, job.recorder
    run = EngineRun()
    if engines.streaming:
        assert engines.launch is not None
        engines.launch.close_input(state.input.prefix_keyed, state.fit)
        run = engines.launch.wait(counters, show_progress, recorder)
        # Requests that lost their custom_id to an earlier line may have run before that was known.
        dropped = settle_losers(staging, job.source)
        counters.done -= dropped
        state.ingest.rows_dropped_after_running = dropped
        work, pending = PendingWork([], 0), 0
        held = held_requests(staging)
        if held:  # early fit: the requests longer than its context run now, on engines fitted to all of them
            streamed, rows = run, staging.num_rows(held)
            log.info(
                "requests longer than the early fit run on engines fitted to the whole input",
                rows=rows,
                max_model_len=fitted.config.engine.vllm.max_model_len,
            )
            engines.launch = EngineLaunch(fitted, staging, job.job_id, rows)
            engines.launch.feed(fitted, held, state.input.prefix_keyed)
            run = merged_runs(streamed, engines.launch.wait(counters, show_progress, recorder))
    else:
        settle_losers(staging, job.source)  # a resumed job whose streamed run was cut short
        work = pending_work(staging, state.input.valid)
        counters.done += work.finished_rows
        pending = state.input.valid - work.finished_rows
    if pending > 0:
        if engines.launch is None:
            recorder.stage_started("engines")
            engines.launch = EngineLaunch(fitted, staging, job.job_id, pending)
        engines.launch.feed(fitted, work.files, state.input.prefix_keyed)
        run = engines.launch.wait(counters, show_progress, recorder)
    elif engines.launch is not None and not engines.streaming:
        engines.launch.cancel()
        engines.launch.wait(counters, show_progress=False)
    if engines.launch is not None:
        recorder.stage_ended("engines")
    return run, work


def _finalize(
    job: _Job,
    engines: _Engines,
    fitted: JobPlan,
    run: EngineRun,
    work: PendingWork,
    counters: JobCounters,
    clock: _RunClock,
) -> Manifest:
    """Sorted, sharded output (runtime/commit/finalize.py), the manifest that accounts for it, and the report
    beside it; the manifest is not written yet (committing writes it last)."""
    state, output, recorder, config = job.state, job.output, job.recorder, fitted.config
    recorder.stage_started("finalize")
    outputs = write_outputs(
        output,
        job.staging,
        config.output_options.rows_per_shard,
        state.input.lines,
        format=fitted.output_format(job.source.file_formats),
        reserve_cpus=engines.launch is None or engines.launch.warm is None,
        table=fitted.table_output,
    )
    manifest = _manifest(job, fitted, run, work, counters, clock, outputs)
    recorder.stage_ended("finalize")
    manifest.stages = recorder.timeline.stages
    if config.observe.report:
        # Before the manifest: a committed job's report is complete; a report that fails costs the job nothing.
        manifest.report = write_report(output, manifest, recorder.timeline, outputs.usage_histograms)
    return manifest


def _manifest(
    job: _Job,
    fitted: JobPlan,
    run: EngineRun,
    work: PendingWork,
    counters: JobCounters,
    clock: _RunClock,
    outputs: FinalizeOutputs,
) -> Manifest:
    """The job's account (pipeline/manifest.py): what it read, ran and wrote, where, how fast, at what cost."""
    state, spec = job.state, fitted.engine_spec()
    usage = request_usage(outputs.usage_histograms)  # percentiles of the shards' histograms
    # Where each stage's tasks ran (node id prefixes): ingest's steps, finalize's; engines are in engine.per_engine.
    placement = Placement(
        ingest=state.ingest.tasks_by_node if state.ingest else None,
        engine_groups=run.groups,
        finalize=outputs.tasks_by_node,
    )
    wall = time.monotonic() - clock.t0
    engines = summarize_engines(run.snapshot)
    decision = decision_of(state.fit)
    remedy = preemption_remedy(
        engines.num_preemptions, engines.effective_args, decision.longest_sequence if decision else None
    )
    if remedy and not run.preemption_warned:
        log.warning(remedy)
    served = job.plan.served
    assert served is not None  # a resolved plan knows every name it serves
    return Manifest(
        format_version=FORMAT_VERSION,
        nightshift_version=__version__,
        job_id=job.job_id,
        dataset=job.plan.dataset_summary,
        created_at=clock.started_at,
        finished_at=dt.datetime.now(dt.timezone.utc),
        input=state.input.summary(),
        ingest=state.ingest,  # where validation ran (Ray node ids), per step
        model=job.model,
        # Rows answered and tokens, per served model (a job may serve one model per pool).
        models=models_summary(
            job.plan.pool_models,
            run.pools,
            {name: (model, served.paths[name]) for name, model in served.adapters.items()},
            outputs.rows_by_model,
        ),
        engine=EngineReport(
            backend=spec.backend,
            args=engines.effective_args or spec.args,
            sampling_defaults=engines.sampling_defaults,
            engines=engines.engines,
            reused=engines.reused,
            kv_cache_tokens_per_engine=engines.kv_cache_tokens_per_engine,
            in_flight=engines.in_flight,
            per_engine=engines.per_engine,
            kv_cache_usage_peak=engines.kv_cache_usage_peak,
            cpu_cores=engines.cpu_cores or None,
            first_ready_at=_utc(engines.first_ready_at),  # engine start ends, generation begins
            fitted=state.fit,
            probed=job.plan.probed or None,
        ),
        counts=outputs.counts,
        shards=outputs.shards,
        tokens=outputs.tokens,
        placement=placement,
        wall_time_s=round(wall, 3),
        throughput=Throughput(
            rows_per_s=round(counters.done / wall, 2) if wall else 0.0,
            output_tokens_per_s=round(counters.completion_tokens / wall, 2) if wall else 0.0,
        ),
        preemptions=engines.num_preemptions,
        preemption_warning=remedy,
        prefix_cache_hit_rate=engines.prefix_cache_hit_rate,
        adapter_loads=engines.adapter_loads,
        routing=run.routing,
        recovery=Recovery(
            resumed=bool(job.resume),
            rows_from_earlier_runs=work.finished_rows,
            requests_retried_after_engine_failure=run.retried_requests,
            duplicate_deliveries_dropped=run.duplicates_dropped,
            leases=run.leases,
            **run.recovery,
        ),
        pools=run.pools,
        storage=StorageRetries(**RetryStats.since(clock.retries_before)),
        # What coordinating cost this process (all its threads): the cluster does the per-row work, so this
        # should grow with files, chunks and shards, not with rows.
        driver=DriverCost(
            cpu_s=round(time.process_time() - clock.cpu0, 3),
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        ),
        usage=usage,
        cost=_cost(fitted, run, engines, wall, clock.t0, outputs),
    )


def _cost(
    plan: JobPlan,
    run: EngineRun,
    engines: EngineSummary,
    wall: float,
    t0: float,
    outputs: FinalizeOutputs,
) -> Cost | None:
    """This run's cost against the hosted price (observe/cost.py), with --gpu-hour-price / --hosted-price."""
    observe = plan.config.observe
    hosted = parse_hosted_price(observe.hosted_price) if observe.hosted_price else None
    gpus = {pool.name: pool.config.gpus_per_engine or 0 for pool in plan.pools}
    pools = {}
    for name, stats in run.pools.items():
        nodes = {e.get("node_id") for e in engines.per_engine.values() if e.get("pool") == name}
        pools[name] = {
            "engines": stats.get("engines", 0),
            "gpus_per_engine": gpus.get(name, 0),
            "nodes": len(nodes),
        }
    ready = engines.first_ready_at
    # Start-up: from this run's start until the first engine could generate (ingest and model load included).
    startup = ready - (time.time() - (time.monotonic() - t0)) if ready else None
    cost = job_cost(
        gpu_hour_price=observe.gpu_hour_price,
        hosted=hosted,
        pools=pools,
        wall_s=wall,
        startup_s=None if startup is None else max(0.0, startup),
        prompt_tokens=outputs.tokens.prompt,
        completion_tokens=outputs.tokens.completion,
        rows=outputs.counts.succeeded,
    )
    return Cost.model_validate(cost) if cost else None


def _utc(epoch: float | None) -> dt.datetime | None:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc) if epoch else None


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
    except (FileNotFoundError, JobStateError) as exc:
        raise PreflightError(str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - an unreachable or denied OUTPUT: say what to change
        raise PreflightError(output_problem(exc, output, reach, "resume from")) from exc
    config = merge_overrides(state.config, {f"storage.{k}": v for k, v in given.items()})
    return config.model_copy(update={"output": output, "job_id": state.job_id})
