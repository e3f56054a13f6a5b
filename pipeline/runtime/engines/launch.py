"""Feeding the engines: each pool's engine actors (Ray Data) pull leased chunks from the one work queue.

    staged work list ─▶ WorkQueue (leases, prefix routing) ─▶ tickets ─▶ engine actors ─▶ staged parts + acks

Ray Data does what it does well — placing each pool's actors by resources and accelerator type, scaling the pool,
restarting a dead actor and re-running its ticket; the queue (runtime/engines/work_queue.py) adds what it lacks: leases that
come back when their engine dies, prefix-aware routing, and pulling across pools, so a faster pool simply leases
more. The number of Ray tasks is the number of engines; the driver reads the queue's totals a few times a second
and never sees a row.

A job whose config names a warm-engine keeper (`engine.warm_engines`, set by the Batch API server) takes its engines
from it instead of a Ray Data pool, and sends them the same tickets (runtime/engines/warm_keeper.py): the engines outlive the job.
"""

from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from pipeline.config import DEFAULT_MAX_NUM_SEQS, JobConfig, PoolConfig
from pipeline.engines.base import EngineSpec, engine_class
from pipeline.fit_record import FitRecord, decision_of
from pipeline.io.staging import StagingArea
from pipeline.job_plan import JobPlan
from pipeline.models import ResolvedModel
from pipeline.observe.progress import JobCounters, ProgressDisplay
from pipeline.observe.recorder import JobRecorder
from pipeline.runtime.background import InBackground
from pipeline.runtime.engines.engine_group import (
    GroupPerActor,
    actor_resources,
    groups_named,
    pool_group,
    release_named,
)
from pipeline.runtime.engines.monitor import EngineWatch, summarize_recovery
from pipeline.runtime.engines.placement import place_pool
from pipeline.runtime.engines.sink import ChunkSink
from pipeline.runtime.preflight import PreflightError

log = structlog.get_logger(__name__)

PROGRESS_POLL_S = 0.5  # how often the driver reads the queue's totals (one small actor call)


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
    # Sharded engines' placement groups, per pool: the node of each rank's bundle, one list per group.
    groups: dict[str, list[list[str]]] = field(default_factory=dict)


# Chunk sizing for engines whose speed is known up front: each lease and acknowledgement costs a few actor calls,
# so a chunk should carry seconds of work; the cap bounds what one chunk holds in memory.
CHUNK_SECONDS = 2.0
MAX_CHUNK_ROWS = 16384


@dataclass(frozen=True)
class FeedPlan:
    """How one pool runs: its engine spec, the size of its chunks and how many requests its engines hold."""

    pool: PoolConfig
    spec: EngineSpec
    chunk_rows: int  # rows per lease
    in_flight: (
        int | None
    )  # requests each engine keeps inside it; None: 2 x its own max_num_seqs, once started
    max_engines: int


def feed_spec(spec: EngineSpec, pool: PoolConfig) -> EngineSpec:
    """The spec a pool's engines start with: the pool's engine overrides over `spec`, and its CPUs."""
    return replace(spec, args={**spec.args, **pool.engine_overrides}, cpus=pool.cpus_per_engine)


def plan_feed(config: JobConfig, spec: EngineSpec, pool: PoolConfig) -> FeedPlan:
    spec = feed_spec(spec, pool)
    known = engine_class(spec.backend).concurrency(spec.args)
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
    return FeedPlan(pool, spec, chunk_rows, in_flight, pool.max_engines or pool.min_engines)


def _pool_dataset(
    plan: FeedPlan, queue: Any, monitor: Any, sink: ChunkSink, job_id: str, max_in_flight: int | None
):
    """One pool's pipeline: a ticket per engine → its engine actors, which lease chunks from the shared queue.

    Ray Data does what it does well — placing the actors by resources and accelerator type, scaling the pool,
    restarting a dead actor and re-running its ticket; the queue adds what it lacks: leases that come back when
    their engine dies, prefix-aware routing, and pulling across pools (a faster pool simply leases more)."""
    import ray

    from pipeline.runtime.engines.engine_actor import EngineWorker

    pool = plan.pool
    group = pool_group(pool, plan.spec)
    placement = actor_resources(pool, group)
    if group is not None:  # each engine actor reserves a placement group of its own as Ray Data creates it
        placement["ray_remote_args_fn"] = GroupPerActor(group, group_prefix(job_id, pool.name))
        _no_remote_args_probes()  # before the dataset: it takes a copy of the context
    tickets = [{"ticket": f"{pool.name}/{i}"} for i in range(plan.max_engines)]
    ds = ray.data.from_items(tickets, override_num_blocks=len(tickets))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # ray_remote_args_fn is Ray Data's, until 2.64
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
            # One ticket per actor, never queued behind another: a ticket runs until the queue is empty, so a second
            # one queued on a busy actor would leave an engine of the pool idle the whole job.
            compute=ray.data.ActorPoolStrategy(
                min_size=pool.min_engines,
                max_size=plan.max_engines,
                max_concurrent_calls_per_actor=1,
                max_tasks_in_flight_per_actor=1,
            ),
            batch_format="numpy",
            **placement,
        )


def _no_remote_args_probes() -> None:
    """Ray Data's high-memory issue detector calls a map's `ray_remote_args_fn` every few seconds to read the
    memory it asks for: with a function that reserves a placement group, each call would reserve another engine's
    worth of resources. It only warns about tasks' memory (engine actors live the whole job), so it is left out."""
    from ray.data import DataContext

    config = DataContext.get_current().issue_detectors_config
    config.detectors = [d for d in config.detectors if d.__name__ != "HighMemoryIssueDetector"]


def group_prefix(job_id: str, pool: str) -> str:
    """The name every placement group of one job's pool starts with."""
    return f"nightshift-{job_id}-{pool}-"


def _warm_tickets(config: JobConfig, job_id: str) -> Any:
    """The job's warm engines (runtime/engines/warm_keeper.py), when its config names a keeper that is there."""
    name = config.engine.warm_engines
    if name is None:
        return None
    from pipeline.runtime.engines.warm_keeper import WarmTickets, find_keeper

    keeper = find_keeper(name)
    if keeper is None:
        log.warning("warm engines not found: this job starts its own", keeper=name)
        return None
    return WarmTickets(keeper, job_id)


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


class EngineLaunch:
    """A job's engines, started before their work is known, then fed and watched.

    Started right after Ray (before ingest): the actors' processes, their placement and the engines' imports —
    seconds on every engine — overlap ingest and fitting. Each engine then waits in its queue's `engine_plan` for
    the engine args fitted to the measured input; `feed` hands every queue its work list and the plans, and
    `wait` watches until every row is staged. An engine that finds no work never builds its engine.

    How many engines a pool runs is decided at launch against `rows_at_most` (an upper bound: the work is not
    counted yet), never more than its chunks of work."""

    def __init__(
        self, plan: JobPlan, staging: StagingArea, job_id: str, rows_at_most: int | None = None
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from pipeline.runtime.engines.monitor import JobMonitor
        from pipeline.runtime.engines.sink import PartWriter, engines_share_disk_with_driver
        from pipeline.runtime.engines.work_queue import WorkQueue

        _wait_for_earlier_driver(job_id)
        config, spec = plan.config, plan.engine_spec()
        self.config = config
        self.job_id = job_id
        self.staging = staging
        self.pool_models = plan.pool_models
        self.served = plan.served
        # Which model each pool serves is known before fitting (fitting changes engine args, not models); each
        # model's requests are a work list of their own, leased only by the pools serving that model.
        early = {pool.name: self._spec_of(spec, pool, None) for pool in plan.pool_configs}
        self.model_of = {name: s.served_model_name for name, s in early.items()}
        self.models = list(dict.fromkeys(self.model_of.values()))
        # Engine counts and CPUs the job left open are decided against the cluster Ray now sees.
        engines_given = bool(config.pools) or config.resources.num_engines is not None
        self.pools = []
        for pool in plan.pool_configs:
            chunk_rows = plan_feed(config, early[pool.name], pool).chunk_rows
            chunks = -(-rows_at_most // chunk_rows) if rows_at_most is not None else None
            self.pools.append(place_pool(pool, feed_spec(early[pool.name], pool), engines_given, chunks))
        # The monitor, the queues and (for a local OUTPUT on a multi-host cluster) the part writer are pinned to
        # the driver's node: they must not go down with a worker node (that is what they help survive), and a
        # local staging directory is on this node's disk.
        # The monitor is named so operators (and tests) can find a job's engines: ray.get_actor(name).snapshot().
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.monitor = (
            ray.remote(num_cpus=0)(JobMonitor)
            .options(name=f"nightshift-monitor-{job_id}", scheduling_strategy=here)
            .remote()
        )
        self.writer = None
        if not engines_share_disk_with_driver(staging.is_local):
            self.writer = ray.remote(num_cpus=0)(PartWriter).options(scheduling_strategy=here).remote(staging)
        sink = ChunkSink(staging, self.writer)
        run_id = uuid.uuid4().hex[:8]
        self.queues: dict[str, Any] = {}
        self.warm = _warm_tickets(config, job_id)
        datasets = []
        for i, model in enumerate(self.models):
            self.queues[model] = (
                ray.remote(num_cpus=0)(WorkQueue)
                .options(scheduling_strategy=here)
                .remote(
                    [],
                    files_on=staging.files,
                    input_closed=False,
                    planned=False,
                    monitor=self.monitor,
                    run_id=f"{run_id}{i}" if len(self.models) > 1 else run_id,
                )
            )
            for pool in self.pools:
                if self.model_of[pool.name] != model:
                    continue
                plan = plan_feed(config, early[pool.name], pool)
                if self.warm is not None:
                    self.warm.add_pool(
                        plan,
                        {
                            "monitor": self.monitor,
                            "queue": self.queues[model],
                            "sink": sink,
                            "chunk_rows": plan.chunk_rows,
                            "max_in_flight": config.engine.max_in_flight,
                        },
                    )
                else:
                    datasets.append(
                        _pool_dataset(
                            plan, self.queues[model], self.monitor, sink, job_id, config.engine.max_in_flight
                        )
                    )
        # The engines run in Ray; the driver only watches: acknowledgements are counted by the queues.
        if self.warm is not None:
            self.warm.acquire()
            self._running = InBackground(self.warm.run)
        else:
            ds = datasets[0].union(*datasets[1:]) if len(datasets) > 1 else datasets[0]
            self._running = InBackground(
                lambda: sum(int(b["chunks"].sum()) for b in ds.iter_batches(batch_size=None))
            )
        self.route = False
        self.keyed_rows = 0
        self._fit: FitRecord | None = None
        self._fed = False

    def _spec_of(self, spec: EngineSpec, pool: PoolConfig, fit: FitRecord | None) -> EngineSpec:
        model = self.pool_models.get(pool.name)
        return pool_spec(spec, model, fit, pool) if model is not None else spec

    def _plans(self, settled: JobPlan) -> dict[str, FeedPlan]:
        """Each placed pool's feed plan on the `settled` plan's engine args: its pool's own fitted values (a named
        pool's max_num_seqs is fitted into its engine_overrides) over the placement decided at launch."""
        config, spec = settled.config, settled.engine_spec()
        plans = {}
        for placed in self.pools:
            pool = settled_pool(placed, settled)
            plans[pool.name] = plan_feed(config, self._spec_of(spec, pool, self._fit), pool)
        return plans

    @property
    def can_stream(self) -> bool:
        """Whether requests can reach the engines while ingest still stages them: one work list (one model)."""
        return len(self.models) == 1

    def stream(
        self, settled: JobPlan, fit: FitRecord | None = None, why: str = "nothing is fitted to the input"
    ) -> None:
        """Streaming: the engines start on the `settled` plan's args (nothing fitted to the input, or `fit`: fitted
        early to a sample of it) and take requests as ingest hands them over (`add_work`), until `close_input`."""
        import ray

        config = settled.config
        self._fit = fit
        plans = self._plans(settled)
        # Whether rows share prompts is known only once they are read: routing is on wherever it could pay. One
        # engine gains too: the queue hands it a prompt's rows together, while the prompt is in its cache.
        self.route = config.routing.prefix_aware
        window = _lookahead(plans.values())
        (queue,) = self.queues.values()
        ray.get(
            queue.start_work.remote(
                [],
                plans,
                route=self.route,
                window_rows=window,
                rows=0,
                input_closed=False,
                tail_rows=_tail(plans.values()),
            )
        )
        self._fed = True
        log.info(f"engines take requests while ingest reads the rest ({why})")

    def add_work(self, parts: list[str]) -> None:
        """More of the work list is staged (streaming)."""
        import ray

        (queue,) = self.queues.values()
        ray.get(queue.add_files.remote(parts))

    def close_input(self, keyed_rows: int, fit: FitRecord | None) -> None:
        """The work list is complete (streaming)."""
        import ray

        self.keyed_rows, self._fit = keyed_rows, fit
        ray.get([queue.close_input.remote() for queue in self.queues.values()])

    def feed(self, fitted: JobPlan, files: list[str], keyed_rows: int = 0) -> None:
        """Hand the queues the work list (the request parts still to run) and each pool its fitted plan."""
        import ray

        config, staging = fitted.config, self.staging
        self._fit = staging.read_job().fit
        plans = self._plans(fitted)
        if len(self.models) > 1:
            assert self.served is not None  # a resolved plan knows every name it serves
            work = {m: staging.requests_for_model(files, self.served.names_of(m)) for m in self.models}
        else:
            work = {self.models[0]: files}
        self.keyed_rows = keyed_rows
        calls = []
        for model, queue in self.queues.items():
            mine = [plan for name, plan in plans.items() if self.model_of[name] == model]
            routed = config.routing.prefix_aware and keyed_rows > 0
            self.route |= routed
            window = _lookahead(mine)
            paths = work[model]
            calls.append(
                queue.start_work.remote(
                    paths,
                    {plan.pool.name: plan for plan in mine},
                    route=routed,
                    window_rows=window,
                    rows=staging.num_rows(paths),
                    tail_rows=_tail(mine),
                )
            )
        ray.get(calls)
        self._fed = True

    def cancel(self) -> None:
        """No more work for any engine (nothing valid, or all of it already staged, or the job failed): engines
        not yet fed end their tickets unbuilt."""
        import ray

        if self._fed:  # what was handed over still runs; nothing more comes
            ray.get([queue.close_input.remote() for queue in self.queues.values()])
        else:
            ray.get([queue.start_work.remote([], {}) for queue in self.queues.values()])

    def abort(self, timeout_s: float = 30.0) -> None:
        """The job failed before or while feeding: end the engines' tickets, then release the job's actors."""
        import ray

        try:
            self.cancel()
            if self.warm is not None:  # warm engines outlive the job: their tickets must end now
                self.warm.stop(timeout_s)
            elif not self._fed:  # unbuilt engines end their tickets at once; fed ones are not waited for
                self._running.wait(timeout_s)
        except Exception as exc:  # noqa: BLE001 - already failing; what matters is the first error
            log.warning("engines not stopped cleanly", error=str(exc))
        for actor in (self.monitor, *self.queues.values(), self.writer):
            if actor is not None:
                ray.kill(actor)
        self._release_groups()

    def _release_groups(self) -> dict[str, list[list[str]]]:
        """Remove the placement groups the job's sharded engines reserved (their actors are done); where each
        group's bundles were, per pool."""
        placed: dict[str, list[list[str]]] = {}
        for pool in self.pools:
            prefix = group_prefix(self.job_id, pool.name)
            for entry in groups_named(prefix):
                nodes = entry.get("bundles_to_node_id") or {}
                placed.setdefault(pool.name, []).append([nodes[i] for i in sorted(nodes)])
            release_named(prefix)
        return placed

    def wait(
        self, counters: JobCounters, show_progress: bool, recorder: JobRecorder | None = None
    ) -> EngineRun:
        """Watch until every engine's ticket has ended; what the engine phase reports to the manifest. `recorder`
        (observe/recorder.py) is handed each reading: the job's timeline and metrics."""
        import ray

        monitor, queues = self.monitor, list(self.queues.values())
        # Live engine numbers (KV usage, preemptions, prefix hits) in the display and logs; warns once on preemptions.
        decision = decision_of(self._fit)
        watch = EngineWatch.of_monitor(monitor, decision.longest_sequence if decision else None)
        seen = {"rows": 0, "failed": 0, "prompt_tokens": 0, "completion_tokens": 0}
        progress_pools: dict[str, dict[str, Any]] = {}

        def take_progress() -> None:
            latest = _merged_progress(ray.get([queue.progress.remote() for queue in queues]))
            delta = {key: latest[key] - seen[key] for key in seen}
            if delta["rows"]:
                counters.add(
                    delta["rows"], delta["failed"], delta["prompt_tokens"], delta["completion_tokens"]
                )
                seen.update({key: latest[key] for key in seen})
            progress_pools.clear()
            progress_pools.update(latest["pools"])

        def record(force: bool = False) -> None:
            if recorder is not None:
                retried = lambda: ray.get(monitor.retried_count.remote(), timeout=10)  # noqa: E731
                recorder.sample(counters, progress_pools, watch.engines, retried, force=force)

        with ProgressDisplay(counters, enabled=show_progress, engines=watch.poll) as progress:
            while not self._running.wait(PROGRESS_POLL_S):
                take_progress()
                progress.update(pools=progress_pools)
                record()
            self._running.result()
            take_progress()
            progress.update(force=True, pools=progress_pools)
            watch.every_s = 0.0  # the engines' last reports, for the last sample
            watch.poll()
            record(force=True)
        run = EngineRun(pools={name: dict(stats) for name, stats in progress_pools.items()})
        reserved = {pool.name: pool.cpus_per_engine for pool in self.pools}
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
        run.groups = self._release_groups()
        if self.warm is not None:
            self.warm.release()  # warm for the next job
        queued = _merged_stats(ray.get([queue.stats.remote() for queue in queues]))
        run.duplicates_dropped = queued["duplicate_acks"]
        run.leases = {
            k: queued[k] for k in ("chunks_issued", "chunks_reissued", "rows_reissued", "duplicate_acks")
        }
        # Routing facts: rows each engine ran; "rows_routed" ran on their key's owner, "rows_stolen" on another
        # engine (so that none idled), "rows_unkeyed" had no shared prompt; "keys": prompts that got an owning
        # engine.
        used = self.route and self.keyed_rows > 0
        run.routing = {
            "enabled": self.config.routing.prefix_aware,
            "used": used,
            "keyed_rows_in_input": self.keyed_rows,
            "rows_by_engine": dict(sorted(queued["served_by"].items())) if used else {},
            **queued["routing"],
        }
        for actor in (monitor, *queues, self.writer):
            if actor is not None:
                ray.kill(actor)
        if run.duplicates_dropped:
            log.warning(
                "dropped chunks that ran twice (their engine died after staging them)",
                chunks=run.duplicates_dropped,
            )
        return run


def merged_runs(first: EngineRun, then: EngineRun) -> EngineRun:
    """One account of two engine launches of a job, one after the other (an early fit's streamed engines, then the
    engines its held requests ran on): rows, tokens and losses add up; each engine is listed once."""
    pools = {name: dict(stats) for name, stats in then.pools.items()}
    for name, stats in first.pools.items():
        if name not in pools:
            pools[name] = dict(stats)
            continue
        for key in ("rows", "failed", "prompt_tokens", "completion_tokens", "engines"):
            if key in stats:
                pools[name][key] = (pools[name].get(key) or 0) + stats[key]
    lost = {**first.recovery["engines_lost"], **then.recovery["engines_lost"]}
    return EngineRun(
        snapshot={**first.snapshot, **then.snapshot},
        pools=pools,
        retried_requests=first.retried_requests + then.retried_requests,
        duplicates_dropped=first.duplicates_dropped + then.duplicates_dropped,
        preemption_warned=first.preemption_warned or then.preemption_warned,
        routing=first.routing,
        leases={
            key: first.leases.get(key, 0) + then.leases.get(key, 0) for key in {*first.leases, *then.leases}
        },
        recovery={
            "engine_restarts": first.recovery["engine_restarts"] + then.recovery["engine_restarts"],
            "engines_lost": lost,
        },
        groups={
            pool: first.groups.get(pool, []) + then.groups.get(pool, [])
            for pool in {*first.groups, *then.groups}
        },
    )


def _lookahead(plans: Iterable[FeedPlan]) -> int:
    """How far a queue reads ahead to find rows of each engine's prompts: a few chunks per engine, bounded, since a
    million-row job must not be read into memory."""
    return min(65536, max(8192, 4 * sum(p.max_engines * p.chunk_rows for p in plans)))


def _tail(plans: Iterable[FeedPlan]) -> int:
    """How many of the job's last rows a queue hands out longest output budget first (held in its memory, so
    bounded): many times what the engines hold at once, so the long ones start well before the end and the last
    rows to run are the short ones. Measured with bench/cluster_sim.py: the last 8,192 of 200,000 rows ordered left
    the last 5% of rows 5.4% of the run; the long ones, started together, then still finish near the end."""
    return min(65536, max(32768, 16 * sum(p.max_engines * p.chunk_rows for p in plans)))


def settled_pool(placed: PoolConfig, settled: JobPlan) -> PoolConfig:
    """A pool as placed at launch (engines and CPUs decided against the cluster then) with its engine_overrides as
    the settled plan has them: fitting writes a named pool's max_num_seqs there."""
    overrides = settled.pool(placed.name).config.engine_overrides
    return (
        placed
        if overrides == placed.engine_overrides
        else placed.model_copy(update={"engine_overrides": overrides})
    )


def pool_spec(spec: EngineSpec, model: ResolvedModel, fit: FitRecord | None, pool: PoolConfig) -> EngineSpec:
    """The engine spec of a pool serving `model`. Engine args fitted to the data are the job model's: a pool of
    another model drops them (vLLM then sizes its context and batch from the model itself) and keeps what was
    given."""
    if model.path == spec.model_path and model.name == spec.served_model_name:
        return spec
    args = dict(spec.args)
    decision = decision_of(fit)
    fitted_len = decision is not None and decision.fitted_max_model_len() is not None
    if fitted_len and "max_model_len" not in pool.engine_overrides:
        args["max_model_len"] = None
    if not (decision and decision.max_num_seqs_given(pool.name)):
        cpu_default = DEFAULT_MAX_NUM_SEQS if pool.gpus_per_engine == 0 else None
        args["max_num_seqs"] = pool.engine_overrides.get("max_num_seqs", cpu_default)
    return replace(spec, model_path=model.path, served_model_name=model.name, args=args)


def models_summary(
    pool_models: dict[str, ResolvedModel],
    pools: dict[str, dict[str, float]],
    adapters: dict[str, tuple[str, str]] | None = None,
    rows_by_name: dict[str, dict[str, int]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per served model: where it came from, its task, the pools serving it, and the rows and tokens they answered;
    and per LoRA adapter of it (`adapters`: name -> (its model, its path)), the rows and tokens that named it
    (`rows_by_name`: finalize's counts per requested name)."""
    out: dict[str, dict[str, Any]] = {}
    for pool, model in pool_models.items():
        entry = out.setdefault(
            model.name,
            {
                "path": model.path,
                "task": model.task,
                "pools": [],
                "rows": 0,
                "prompt_tokens": 0,
                "completion_tokens": 0,
            },
        )
        entry["pools"].append(pool)
        stats = pools.get(pool) or {}
        for key in ("rows", "prompt_tokens", "completion_tokens"):
            entry[key] += int(stats.get(key) or 0)
    for name, (model, path) in (adapters or {}).items():
        counts = (rows_by_name or {}).get(name, {})
        out[model].setdefault("adapters", {})[name] = {
            "path": path,
            **{key: int(counts.get(key, 0)) for key in ("rows", "prompt_tokens", "completion_tokens")},
        }
    return out


def _merged_progress(each: list[dict[str, Any]]) -> dict[str, Any]:
    """The work queues' totals as one (a job serving several models has a queue per model)."""
    merged: dict[str, Any] = {"rows": 0, "failed": 0, "prompt_tokens": 0, "completion_tokens": 0, "pools": {}}
    for one in each:
        for key in ("rows", "failed", "prompt_tokens", "completion_tokens"):
            merged[key] += one[key]
        merged["pools"].update(one["pools"])  # a pool leases from its model's queue only
    return merged


def _merged_stats(each: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"served_by": {}, "routing": {}}
    for one in each:
        merged["served_by"].update(one["served_by"])
        for key, value in one.items():
            if isinstance(value, int):
                merged[key] = merged.get(key, 0) + value
        for key, value in one["routing"].items():
            merged["routing"][key] = merged["routing"].get(key, 0) + value
    return merged
