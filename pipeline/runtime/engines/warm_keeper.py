"""Warm engines: engine actors that outlive one job, so the next job of the same model does not pay engine start.

A job's engines normally live as long as its Ray Data actor pool (runtime/engines/launch.py). A long-lived coordinator — the
Batch API server, one job per batch — instead keeps an `EngineKeeper` (a named actor it owns): jobs whose config
names it (`engine.warm_engines`) take their engines from it, hand each a ticket, and give them back when they end.

    EngineKeeper (owned by the server) ─▶ WarmEngine actors (one engine each, kept between jobs)
    job driver: acquire ─▶ serve_job(ticket) on each ─▶ release        (the tickets are runtime/engines/engine_actor.py's pull loop)

- Reuse: an engine is reused when it can serve the new job's fitted plan exactly (engines.base.engine_covers: same
  model and args, a context at least as long); otherwise it is rebuilt inside its actor, whose process, imports and
  placement stay.
- Idle engines are stopped after `idle_seconds`, and at once when another kind of engine needs their resources or
  an engine of another job waits to be placed.
- Failure: a WarmEngine whose engine dies exits, Ray restarts it (max_restarts), and the job sends the ticket again
  (the queue hands the ticket's unacknowledged chunks out again, as with Ray Data). A job that stops — cancelled, out
  of its window, or its driver killed — has its tickets dropped (`drop_job`): their requests leave the engine and
  nothing of the job is staged after the call returns, so a resumed job lists exactly what is left.
- Ownership: the keeper owns the engines and its creator owns the keeper: a server that dies takes its engines
  with it, and the server that replaces it starts a new keeper under the same name.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import structlog

from pipeline.engines.base import EngineSpec
from pipeline.runtime.engines.engine_actor import EngineWorker
from pipeline.runtime.engines.engine_group import (
    actor_resources,
    in_group,
    pool_group,
    release_named,
    reserve,
)
from pipeline.topology import EngineGroup

log = structlog.get_logger(__name__)

NAMESPACE = "nightshift"  # the keeper's Ray namespace: jobs find it by name from their own drivers
TICKET_ATTEMPTS = 5  # sends of one ticket before the job fails (an engine that dies every time it starts)


class TicketDropped(RuntimeError):
    """The keeper ended this job's tickets (its coordinator stopped the job): the job must not send them again."""


class WarmEngine(EngineWorker):
    """One engine, serving one job's ticket at a time, kept between jobs."""

    def __init__(self, spec: EngineSpec, pool: str) -> None:
        super().__init__(spec, pool)
        self._job: str | None = None
        self._ticket: asyncio.Task | None = None
        self._dropping: str | None = None
        # Per job, the first run still served: a ticket of an earlier run (sent before its coordinator dropped the
        # job, arriving after the drop) is refused, never served. Runs are numbered by the keeper (`drop_job`).
        self._first_run: dict[str, int] = {}

    def ready(self) -> bool:
        return True

    async def serve_job(self, ticket: str, job_id: str, run: int, pool: str, wiring: dict[str, Any]) -> int:
        """Run one ticket of `job_id`'s run number `run` (its pull loop over the job's queue); the chunks it ran."""
        if run < self._first_run.get(job_id, 0):
            raise TicketDropped(f"job {job_id} was stopped; its engines were taken back")
        if self._job is not None and self._job != job_id:
            raise RuntimeError(f"engine busy with job {self._job}; job {job_id} was handed it")
        self._job = job_id
        self._ticket = asyncio.current_task()
        self.bind(pool=pool, job_id=job_id, **wiring)
        try:
            return await self.serve(ticket)
        except asyncio.CancelledError:
            if self._dropping != job_id:
                raise
            raise TicketDropped(f"job {job_id} was stopped; its engines were taken back") from None
        finally:
            self._report(force=True)  # the job's last numbers for this engine
            self.monitor = self.queue = self.sink = None
            self._job = self._ticket = None

    async def drop_job(self, job_id: str, next_run: int) -> None:
        """End this engine's ticket of `job_id`, if it runs one, and refuse the tickets of its runs before
        `next_run`; returns once nothing of it runs or is staged."""
        self._first_run[job_id] = max(next_run, self._first_run.get(job_id, 0))
        ticket = self._ticket
        if self._job != job_id or ticket is None:
            return
        if self._dropping != job_id:
            # Cancelled once: a second cancel (the coordinator and the job's own driver both drop it) would land in
            # the ticket's settling and end it before its chunks being staged are written.
            self._dropping = job_id
            ticket.cancel()
        await asyncio.gather(ticket, return_exceptions=True)
        await self._staged()  # nothing of the job is written after the drop returns
        self._dropping = None


@dataclass
class _Kept:
    handle: Any
    kind: str  # what the actor was placed with (engines.base spec identity + resources)
    job: str | None = None  # the job holding it; None: idle
    idle_since: float = field(default_factory=time.monotonic)
    placed: bool = False  # the actor is running (not waiting for resources)
    group_name: str | None = None  # a sharded engine's placement group, removed when the engine is stopped


def engine_kind(spec: EngineSpec, options: dict[str, Any]) -> str:
    """Engines of one kind are interchangeable: the same backend and model, placed with the same resources, and
    fetching media by the same policy (an engine keeps the one it started with)."""
    return json.dumps(
        [spec.backend, spec.model_path, spec.served_model_name, spec.cpus, options, spec.media.model_dump()],
        sort_keys=True,
        default=str,
    )


class EngineKeeper:
    """Hands warm engines to jobs and stops the idle ones (an async Ray actor, named, owned by the server)."""

    def __init__(self, idle_seconds: float) -> None:
        self.idle_seconds = idle_seconds
        self._kept: list[_Kept] = []
        self._reaper: asyncio.Task | None = None
        self._runs: dict[str, int] = {}  # per job, the number of its current run: each drop starts the next
        self.started = 0  # engine actors created, over the keeper's life
        self.reused = 0  # engines handed to a job that another job had used
        self._active_at = time.monotonic()  # the last call of a job: its engines' idle time counts from it

    async def acquire(
        self, job_id: str, wanted: list[tuple[EngineSpec, str, int, dict[str, Any], EngineGroup | None]]
    ) -> tuple[int, list[list[Any]]]:
        """Engines for each of the job's pools — `wanted`: (spec, pool, count, actor options, the placement group
        each engine reserves or None) — idle ones of the same kind first, new ones for the rest; and the number of
        the job's run, which its tickets carry."""
        import ray

        self._active_at = time.monotonic()
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())
        kinds = [engine_kind(spec, {**options, "group": group}) for spec, _, _, options, group in wanted]
        handed: list[list[_Kept]] = []
        for kind, (_, _, count, _, _) in zip(kinds, wanted, strict=True):
            taken = [k for k in self._kept if k.job is None and k.kind == kind][:count]
            for k in taken:
                k.job = job_id
            handed.append(taken)
        # Idle engines of kinds this job does not run hold cores or accelerators its new ones may need.
        self._stop([k for k in self._kept if k.job is None and k.kind not in kinds])
        cls = ray.remote(WarmEngine)
        for kind, (spec, pool, count, options, group), taken in zip(kinds, wanted, handed, strict=True):
            reused = len(taken)
            self.reused += reused
            for _ in range(count - reused):
                group_name = None
                placed = dict(options)
                if group is not None:  # a sharded engine: its group is reserved first, and removed with it
                    group_name = f"nightshift-warm-{uuid.uuid4().hex[:12]}"
                    placed.update(in_group(reserve(group, group_name)))
                handle = cls.options(max_restarts=-1, **placed).remote(spec, pool)
                kept = _Kept(handle, kind, job=job_id, group_name=group_name)
                self._kept.append(kept)
                taken.append(kept)
                self.started += 1
                asyncio.get_running_loop().create_task(self._placed(kept))
            log.info("engines handed out", job=job_id, pool=pool, warm=reused, started=count - reused)
        return self._runs.get(job_id, 0), [[k.handle for k in taken] for taken in handed]

    async def _placed(self, kept: _Kept) -> None:
        try:
            await kept.handle.ready.remote()
            kept.placed = True
        except Exception:  # noqa: BLE001 - stopped before it was placed
            pass

    async def release(self, job_id: str) -> None:
        """The job is done with its engines: they wait, warm, for the next job."""
        self._active_at = time.monotonic()
        mine = [k for k in self._kept if k.job == job_id]
        for k in mine:
            k.job, k.idle_since = None, time.monotonic()
        if any(not k.placed and k.job is not None for k in self._kept):
            # Another job's engine waits for resources these hold: it must not wait for their idle time.
            self._stop(mine)

    async def drop_job(self, job_id: str) -> None:
        """Stop the job's tickets (a stopped or vanished driver), then release its engines. A later run of the job
        gets the next run number: a ticket of this one that reaches an engine only now is refused there."""
        self._active_at = time.monotonic()
        self._runs[job_id] = next_run = self._runs.get(job_id, 0) + 1
        mine = [k for k in self._kept if k.job == job_id]
        if mine:
            await asyncio.gather(
                *(k.handle.drop_job.remote(job_id, next_run) for k in mine), return_exceptions=True
            )
        await self.release(job_id)

    def stop_idle(self) -> int:
        """Stop every idle engine now (the night window closed: the accelerators are free for the day)."""
        idle = [k for k in self._kept if k.job is None]
        self._stop(idle)
        return len(idle)

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "engines": [
                {
                    "backend": kind[0],
                    "model": kind[2] or kind[1],
                    "job": k.job,
                    "placed": k.placed,
                    "idle_s": None if k.job else round(now - k.idle_since, 1),
                }
                for k, kind in ((k, json.loads(k.kind)) for k in self._kept)
            ],
            "started": self.started,
            "reused": self.reused,
            # Seconds since a job last called or held an engine (None while one does): a coordinator that lives
            # only for its engines (runtime/hosting/warm_runtime.py) ends after its idle timeout of it.
            "idle_s": None if any(k.job for k in self._kept) else round(now - self._active_at, 1),
        }

    def _stop(self, kept: list[_Kept]) -> None:
        import ray

        for k in kept:
            self._kept.remove(k)
            ray.kill(k.handle, no_restart=True)
            if k.group_name is not None:
                release_named(k.group_name)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, min(10.0, self.idle_seconds / 4)))
            now = time.monotonic()
            expired = [k for k in self._kept if k.job is None and now - k.idle_since >= self.idle_seconds]
            if expired:
                log.info("idle engines stopped", engines=len(expired), idle_seconds=self.idle_seconds)
                self._stop(expired)


def start_keeper(name: str, idle_seconds: float) -> Any:
    """The keeper for a coordinator (the server): named, so its jobs find it; owned by the caller."""
    import ray

    return (
        ray.remote(num_cpus=0)(EngineKeeper)
        # get_if_exists: a server restarted on the same data dir while its predecessor's keeper is still being
        # reaped takes that one rather than failing on the name.
        .options(name=name, namespace=NAMESPACE, max_concurrency=1000, get_if_exists=True)
        .remote(idle_seconds)
    )


def find_keeper(name: str) -> Any | None:
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def _until_restarted(handle: Any) -> None:
    """Returns once the engine actor answers again. A ticket sent while Ray is still restarting the actor fails at
    once ("the actor is restarting") without reaching it; counted as an attempt, a slow restart (an engine start
    on a loaded node) would use a dying ticket's sends up before its poisoned chunk was ever isolated. A call that
    may be retried without limit is queued by Ray until the restarted actor is up; an actor that cannot come back
    raises ActorDiedError here."""
    import ray

    ray.get(handle.ready.options(max_task_retries=-1).remote())


class WarmTickets:
    """A job's side: its engines taken from the keeper, one ticket on each, sent again if its engine restarts."""

    def __init__(self, keeper: Any, job_id: str) -> None:
        import ray

        self.keeper, self.job_id = keeper, job_id
        # An earlier driver of this job (killed, then resumed) may still have tickets running: they end first,
        # so the pending rows listed after this are exactly what is left.
        ray.get(keeper.drop_job.remote(job_id))
        self._pools: list[tuple[Any, dict[str, Any]]] = []
        self._tickets: list[tuple[Any, str, str, dict[str, Any]]] = []
        self._run = 0  # this run's number, from the keeper (acquire)
        self._stopping = False

    def add_pool(self, plan: Any, wiring: dict[str, Any]) -> None:
        """A pool whose engines to take (plan: runtime/feed.FeedPlan); `wiring`: the job's queue, monitor, sink,
        chunk size and in-flight window for them. Taken all at once, by `acquire`."""
        self._pools.append((plan, wiring))

    def acquire(self) -> None:
        """Every pool's engines, in one call: the keeper sees all the kinds this job runs before it stops idle
        engines that no pool of the job can use."""
        import ray

        wanted = []
        for plan, _ in self._pools:
            group = pool_group(plan.pool, plan.spec)
            wanted.append(
                (plan.spec, plan.pool.name, plan.max_engines, actor_resources(plan.pool, group), group)
            )
        self._run, handles = ray.get(self.keeper.acquire.remote(self.job_id, wanted))
        for (plan, wiring), pool_handles in zip(self._pools, handles, strict=True):
            for i, handle in enumerate(pool_handles):
                self._tickets.append((handle, f"{plan.pool.name}/{i}", plan.pool.name, wiring))

    def run(self) -> int:
        """Until every ticket has ended: the chunks they ran."""
        import ray

        def send(ticket: tuple[Any, str, str, dict[str, Any]]) -> Any:
            handle, name, pool, wiring = ticket
            return handle.serve_job.remote(name, self.job_id, self._run, pool, wiring)

        out = {send(t): t for t in self._tickets}
        sends = {t[1]: 1 for t in self._tickets}
        chunks = 0
        while out:
            (done,), _ = ray.wait(list(out), num_returns=1)
            ticket = out.pop(done)
            try:
                chunks += ray.get(done)
            except Exception as exc:
                if self._stopping:
                    continue
                if isinstance(exc, TicketDropped) or sends[ticket[1]] >= TICKET_ATTEMPTS:
                    raise
                # Its engine died (Ray restarts the actor) or failed a chunk: the queue hands the ticket's
                # unacknowledged chunks out again when it restarts.
                log.warning("engine ticket sent again", ticket=ticket[1], error=str(exc).splitlines()[0])
                _until_restarted(ticket[0])
                if self._stopping:
                    continue
                sends[ticket[1]] += 1
                out[send(ticket)] = ticket
        return chunks

    def stop(self, timeout_s: float = 60.0) -> None:
        """The job stops early: its tickets end (requests leave the engines), the engines go back warm."""
        import ray

        self._stopping = True
        ray.get(self.keeper.drop_job.remote(self.job_id), timeout=timeout_s)

    def release(self) -> None:
        import ray

        ray.get(self.keeper.release.remote(self.job_id))
