"""The engine actor: a Ray Data callable class that hosts one engine and feeds it from the work queue.

Ray Data places the actors (resources, accelerator type, restarts) and hands each one a *ticket*; a ticket is a
pull loop: lease a chunk of requests from the queue, run it, stage its rows (runtime/engines/sink.py), acknowledge, lease
the next — with about 2 x the engine's effective max_num_seqs requests inside the engine and one chunk in reserve,
so continuous batching stays full across chunk boundaries. The number of Ray tasks is the number of engines, not of
chunks; only acknowledgements travel back.

Failure handling: if the engine dies, the actor process exits on purpose; Ray restarts it and re-runs its ticket,
and the queue hands the ticket's unacknowledged chunks out again (same chunk, same part name: staged at most once).
The job monitor's attempt ledger decides which re-run rows go alone and which are isolated as `engine_error` (see
runtime/engines/monitor.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa
import structlog

from pipeline.config import DEFAULT_MAX_NUM_SEQS
from pipeline.endpoints import json_outcome
from pipeline.engines.base import (
    Engine,
    EngineRequest,
    EngineResult,
    EngineSpec,
    build_engine,
    engine_class,
    engine_covers,
)
from pipeline.io.staging import STAGED_SCHEMA
from pipeline.json_codec import loads
from pipeline.protocol import ErrorCode, dumps, result_record
from pipeline.runtime.engines.inflight import ChunkSlots, EngineWindow
from pipeline.runtime.engines.sink import ChunkSink

log = structlog.get_logger(__name__)

# How often an engine pushes its numbers (KV usage, preemptions, prefix hits) to the job monitor while it lives.
REPORT_EVERY_S = 2.0


def isolated_result(custom_id: str) -> EngineResult:
    message = (
        "the engine died every time it ran this request (including once on its own); it was isolated so the "
        "rest of the batch could finish"
    )
    body = {
        "error": {
            "message": message,
            "type": "EngineError",
            "param": None,
            "code": ErrorCode.ENGINE_ERROR.value,
        }
    }
    return EngineResult(custom_id, 500, body, ErrorCode.ENGINE_ERROR)


def result_table(
    results: list[EngineResult],
    lines: list[int],
    sources: list[str],
    pool: str,
    job_id: str | None = None,
    leased_at: float | None = None,
    models: list[str | None] | None = None,
    requests: list[EngineRequest] | None = None,
) -> pa.Table:
    """Finished results as staged rows (io.staging.STAGED_SCHEMA), built column by column: an Arrow table with
    its schema given, so Ray Data need not infer types from Python values row by row.

    `leased_at` (time.monotonic() when the chunk reached this engine actor) times each request: its queue wait
    until it entered the engine, and its time inside. A result the backend did not time (a chunk answered at once,
    a request run alone) counts the whole chunk as engine time. `models`: each request's `model` (a served model
    or a LoRA adapter), counted per name at finalize."""
    now = time.monotonic()
    leased = now if leased_at is None else leased_at

    def waited(r: EngineResult) -> float:
        return round(max(0.0, (r.started_at if r.started_at is not None else leased) - leased), 6)

    def inside(r: EngineResult) -> float:
        start = r.started_at if r.started_at is not None else leased
        return round(max(0.0, (r.finished_at if r.finished_at is not None else now) - start), 6)

    def record(result: EngineResult) -> str:
        seed = f"{job_id}:{result.custom_id}" if job_id else None
        return dumps(result_record(result.custom_id, result.body, result.status_code, seed))

    columns = {
        "custom_id": [r.custom_id for r in results],
        "line": lines,
        "source": sources,
        "error_code": [r.error_code.value if r.error_code else None for r in results],
        "prompt_tokens": [r.prompt_tokens for r in results],
        "completion_tokens": [r.completion_tokens for r in results],
        "pool": [pool] * len(results),
        "record": [record(r) for r in results],
        "queue_wait_s": [waited(r) for r in results],
        "engine_s": [inside(r) for r in results],
        "model": models if models is not None else [None] * len(results),
        # Decided here, where each request's body is at hand (finalize sees only the answers).
        "structured_json": [
            json_outcome(q.url, q.body, r.status_code, r.body) for q, r in zip(requests, results, strict=True)
        ]
        if requests is not None
        else [None] * len(results),
    }
    return pa.table(columns, schema=STAGED_SCHEMA)


def _total(table: pa.Table, column: str) -> int:
    import pyarrow.compute as pc

    return int(pc.sum(table.column(column)).as_py() or 0)


class Activity:
    """When an engine had chunks inside it: first start, last finish, and the seconds with at least one running.
    Busy seconds over the span between its first and last request show whether it waited on the queue."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.busy_s = 0.0
        self.rows = 0
        self.chunks = 0
        # Tokens of the rows it finished: its own tok/s, per engine (the queue counts them per pool only).
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._running = 0
        self._since = 0.0

    def begin(self) -> None:
        now = time.time()
        if self.first is None:
            self.first = now
        if not self._running:
            self._since = now
        self._running += 1

    def end(self, rows: int, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        now = time.time()
        self._running -= 1
        if not self._running:
            self.busy_s += now - self._since
        self.last = now
        self.rows += rows
        self.chunks += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def as_dict(self) -> dict[str, Any]:
        busy = self.busy_s + (time.time() - self._since if self._running else 0.0)
        span = (self.last or 0.0) - (self.first or 0.0)
        return {
            "rows": self.rows,
            "chunks": self.chunks,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "first_request_at": self.first,
            "last_result_at": self.last,
            "busy_s": round(busy, 3),
            "busy_share": round(min(1.0, busy / span), 4) if span > 0 else None,
        }


def in_flight_window(engine: Engine) -> int:
    """2 x the sequences the engine runs at once, as it reports them after starting (vLLM decides max_num_seqs
    itself when it was not given), so one batch waits inside while the next runs."""
    return 2 * int(engine.concurrency(engine.effective_args()) or DEFAULT_MAX_NUM_SEQS)


def _has_gpus() -> bool:
    try:
        import ray

        return ray.is_initialized() and bool(ray.get_gpu_ids())
    except Exception:  # noqa: BLE001 - outside an actor: no accelerators were assigned
        return False


def _computes_on_own_cores(spec: EngineSpec) -> bool:
    """A CPU engine given whole cores (no accelerator): it claims its cores on the node, and starts in a slot."""
    return engine_class(spec.backend).computes_on_cpu_cores and spec.cpus >= 1 and not _has_gpus()


def _actor_context() -> tuple[str | None, bool]:
    """This actor's node, and whether Ray restarted it (None, False outside a Ray actor: unit tests)."""
    try:
        import ray

        if not ray.is_initialized():
            return None, False
        context = ray.get_runtime_context()
        return context.get_node_id(), bool(context.was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - facts for the manifest, never a reason to fail the engine
        return None, False


# Rows an engine may hold (leased, not yet staged) over rows it has yet to run: finished rows wait for their chunk's
# slowest request; past this, one very long request holds up the engine's feed rather than its memory.
HOLD_FACTOR = 4


class EngineWorker:
    """One engine per actor, started lazily inside the actor's event loop (vLLM binds its tasks to that loop)."""

    def __init__(
        self,
        spec: EngineSpec,
        pool: str = "default",
        monitor: Any = None,
        job_id: str | None = None,
        queue: Any = None,
        sink: ChunkSink | None = None,
        chunk_rows: int = 64,
        max_in_flight: int | None = None,
    ) -> None:
        self.spec = spec
        self.engine: Engine | None = None
        self._built_spec: EngineSpec | None = None  # what the running engine was built for
        self._starting: asyncio.Lock | None = None
        self._last_report = 0.0
        self._ready_at: float | None = None  # wall clock: compared across processes
        self._reporter: asyncio.Task | None = None
        # A CPU engine's cluster.cpu_cores.CoreClaim, held while the actor lives.
        self._core_claim: Any = None
        # Chunks being written out (threads: they cannot be cancelled).
        self._staging: set[asyncio.Future] = set()
        self._node_id, self._restarted = _actor_context()
        self.bind(pool, monitor, job_id, queue, sink, chunk_rows, max_in_flight)
        # The engine starts with the first ticket (it must start inside the actor's event loop), but its imports
        # need no loop: they begin now, while Ray Data is still placing the other engines.
        self._preloading = threading.Thread(
            target=self._preload, args=(spec,), name="engine-preload", daemon=True
        )
        self._preloading.start()

    def bind(
        self,
        pool: str,
        monitor: Any,
        job_id: str | None,
        queue: Any,
        sink: ChunkSink | None,
        chunk_rows: int,
        max_in_flight: int | None,
    ) -> None:
        """The job this actor serves: its queue, monitor (stats + attempt ledger; None in unit tests) and staging
        sink, and fresh numbers for its manifest. A warm engine (runtime/engines/warm_keeper.py) is bound again for each job; its
        engine stays, if it can serve the job's plan."""
        self.pool, self.monitor, self.job_id, self.queue, self.sink = pool, monitor, job_id, queue, sink
        self.chunk_rows = chunk_rows
        # Requests inside the engine at once: given, or 2 x the engine's own max_num_seqs once it has started
        # (on a GPU only the engine knows how many sequences its KV cache holds).
        self._max_in_flight_given = max_in_flight
        self.window = max_in_flight or (in_flight_window(self.engine) if self.engine is not None else None)
        # asyncio primitives of this job's window, created in the actor's event loop once the engine is built
        self._gate: asyncio.Condition | None = None
        self._window: EngineWindow | None = None
        self._in_flight, self._solo = 0, False
        self._kv_usage_peak: float | None = None
        self.activity = Activity()  # when this engine had work: its busy share, for the manifest
        self.actor_id = f"{pool}-{os.getpid()}"
        self._reused = self.engine is not None  # built before this job: its start not paid by it
        # A warm engine's counters run across jobs: this job's numbers are counted from here (and a warm engine
        # serving many keys never shows one key what another's jobs did).
        self._counted_from = self.engine.stats() if self.engine is not None else None

    async def _engine(self) -> Engine:
        if self.engine is None or not engine_covers(self._built_spec, self.spec):
            if self._starting is None:
                self._starting = asyncio.Lock()
            async with self._starting:
                if self.engine is not None and not engine_covers(self._built_spec, self.spec):
                    # A warm engine built for another job's plan (a shorter context, another model): rebuilt in
                    # this process, whose imports and placement stay.
                    log.info("engine rebuilt for this job's plan", was=self._built_spec, now=self.spec)
                    old, self.engine, self._reused = self.engine, None, False
                    old.shutdown()
                if self.engine is None:
                    await asyncio.to_thread(self._preloading.join)
                    # The engine gets its own copy: it may fill in its args as it starts (vLLM on CPU sets
                    # enforce_eager), and the next plan is compared with what was asked for.
                    wanted = replace(self.spec, args=dict(self.spec.args))
                    engine = build_engine(await self._with_adapters(self._spec_with_cores(wanted)))
                    await self._or_die(engine.start())  # a rank lost while it starts: the engine is rebuilt
                    self._ready_at = time.time()
                    self.engine, self._built_spec = engine, wanted
                    self._counted_from = None  # a new engine's counters start at this job
                    self.window = self._max_in_flight_given or in_flight_window(engine)
                    self._report(force=True)
                    if self._reporter is None:
                        # On a clock, not per batch: a batch of long generations can take minutes, and the job
                        # must see the KV cache fill (and preemptions start) while it happens.
                        self._reporter = asyncio.get_running_loop().create_task(self._report_loop())
        return self.engine

    async def _with_adapters(self, spec: EngineSpec) -> EngineSpec:
        """An engine that reads its LoRA adapters' files gets them on this node (remote ones copied here once, for
        every engine of the node and later jobs: io/adapter_files.py)."""
        if not spec.args.get("lora_modules") or not engine_class(spec.backend).reads_adapter_files:
            return spec
        from pipeline.io.adapter_files import stage_adapters

        staged = await asyncio.to_thread(stage_adapters, spec.args, spec.adapter_storage)
        return replace(spec, adapter_dirs=staged)

    def _spec_with_cores(self, wanted: EngineSpec) -> EngineSpec:
        """A CPU engine computes on whole cores of its own: claimed here, on its node, for the life of this actor
        (the claim is released with the process, so a restarted actor's engine can take them again)."""
        spec = replace(wanted, args=dict(wanted.args))
        if not _computes_on_own_cores(spec):
            return spec
        from cluster.cpu_cores import claim_cores

        if self._core_claim is None:  # a rebuilt engine computes on the cores this actor already holds
            self._core_claim = claim_cores(int(spec.cpus))
        if self._core_claim is None:
            return spec
        return replace(spec, cpu_cores=tuple(self._core_claim.cores))

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            try:
                self._report(force=True)
            except Exception as exc:  # noqa: BLE001 - numbers are best effort; the work must go on
                log.warning("engine stats not reported", error=str(exc))

    @staticmethod
    def _preload(spec: EngineSpec) -> None:
        # CPU engines of one node import a few at a time (cluster/cpu_cores.py: start_slot), so on a small node
        # the first of them reaches its first token while the others still import; an engine on a GPU imports
        # at once.
        from cluster.cpu_cores import start_slot

        try:
            with start_slot() if _computes_on_own_cores(spec) else contextlib.nullcontext():
                engine_class(spec.backend).preload()
        except Exception as exc:  # noqa: BLE001 - start() imports again and reports the real error
            log.warning("engine preload failed; the engine will import at start", error=str(exc))

    def _report(self, force: bool = False) -> None:
        if self.monitor is None or self.engine is None:
            return
        now = time.monotonic()
        if force or now - self._last_report > REPORT_EVERY_S:
            self._last_report = now
            stats = self.engine.stats().since(self._counted_from)
            if stats.kv_cache_usage is not None:
                self._kv_usage_peak = max(self._kv_usage_peak or 0.0, stats.kv_cache_usage)
            info = {
                "pool": self.pool,
                "in_flight_window": self.window,
                "requests_inside": self._in_flight,  # admitted into the engine now (running or waiting)
                "activity": self.activity.as_dict(),
                "pid": os.getpid(),
                "node_id": self._node_id,
                "restarted": self._restarted,  # Ray restarted this actor (its engine, or its node, died)
                "ready_at": self._ready_at,
                "reused": self._reused,  # a warm engine: built before this job, its start not paid by it
                "stats": {**stats.__dict__, "kv_cache_usage_peak": self._kv_usage_peak},
                "effective_args": self.engine.effective_args(),
                "sampling_defaults": self.engine.sampling_defaults(),
            }
            self.monitor.report.remote(self.actor_id, info)

    def _conditions(self) -> asyncio.Condition:
        # Created lazily: asyncio primitives bind to the actor's event loop, which does not exist in __init__.
        if self._gate is None:
            self._gate = asyncio.Condition()
            self._window = EngineWindow(self.window)
        return self._gate

    def _engine_window(self) -> EngineWindow:
        self._conditions()
        assert self._window is not None
        return self._window

    async def _run_normal(
        self, engine: Engine, requests: list[EngineRequest], slots: ChunkSlots
    ) -> list[EngineResult]:
        """Run a chunk's ordinary requests together, at most `max_in_flight` inside the engine at once.

        The chunk is admitted as a whole (one wait, not one per row): it waits only while a request runs alone."""
        gate = self._conditions()
        async with gate:
            await gate.wait_for(lambda: not self._solo)
            self._in_flight += len(requests)
        try:
            return await self._or_die(engine.generate_all(requests, slots))  # type: ignore[arg-type]
        finally:
            async with gate:
                self._in_flight -= len(requests)
                gate.notify_all()

    async def _run_alone(self, engine: Engine, request: EngineRequest, mode: str) -> EngineResult:
        """A suspect request: "solo" waits until the engine is otherwise idle and keeps it so while it runs;
        "isolate" does not run it at all (it already killed an engine while running alone)."""
        if mode == "isolate":
            log.warning("request isolated after repeated engine deaths", custom_id=request.custom_id)
            return isolated_result(request.custom_id)
        gate = self._conditions()
        async with gate:
            await gate.wait_for(lambda: not self._solo and self._in_flight == 0)
            self._solo = True
            self._in_flight += 1
            await self.monitor.solo_started.remote(request.custom_id)
        try:
            return await self._or_die(engine.answer(request))
        finally:
            async with gate:
                self._in_flight -= 1
                self._solo = False
                self.monitor.solo_finished.remote(request.custom_id)
                gate.notify_all()

    async def _or_die(self, work: Awaitable[Any]) -> Any:
        try:
            return await work
        except Exception as exc:
            if engine_class(self.spec.backend).is_engine_dead(exc):
                # A dead engine cannot be revived in-process. Exiting lets Ray restart this actor with a fresh
                # engine and re-run every batch that was in flight here (none of their rows were returned).
                log.error("engine died; restarting the actor", error=str(exc))
                await self._tell_died(type(exc).__name__)
                os._exit(1)
            raise

    async def _tell_died(self, cause: str) -> None:
        """Record the cause with the job monitor (for the manifest) before exiting; never wait long for it."""
        if self.monitor is None:
            return
        try:
            await asyncio.wait_for(self.monitor.engine_died.remote(self.actor_id, cause), timeout=5)
        except Exception as exc:  # noqa: BLE001 - the restart matters, the record does not
            log.warning("engine death not recorded", error=str(exc))

    async def _plan(self, chunk: int, attempt: int, custom_ids: list[str]) -> dict[str, str]:
        """How to run each request (see JobMonitor.begin). Without a reachable monitor, all run normally: losing
        poison isolation is better than losing the batch."""
        if self.monitor is None:
            return {}
        try:
            return await self.monitor.begin.remote(
                chunk, self.actor_id, len(custom_ids), attempt, custom_ids if attempt > 1 else None
            )
        except Exception as exc:  # noqa: BLE001 - RayActorError and friends
            log.warning("job monitor unreachable; running without the attempt ledger", error=str(exc))
            return {}

    async def run_chunk(self, table: pa.Table, chunk: int = 0, attempt: int = 1) -> pa.Table:
        """One chunk of requests through the engine: its finished rows (io.staging.STAGED_SCHEMA)."""
        leased_at = time.monotonic()
        engine = await self._engine()
        # Whole columns, not a dict per row: at a million rows per-row objects are the cost that shows.
        ids, urls, bodies = (table.column(name).to_pylist() for name in ("custom_id", "url", "body"))
        requests = [EngineRequest(i, u, loads(b)) for i, u, b in zip(ids, urls, bodies, strict=True)]
        plan = await self._plan(chunk, attempt, ids)
        normal = [n for n, r in enumerate(requests) if plan.get(r.custom_id, "normal") == "normal"]
        suspects = [n for n, r in enumerate(requests) if plan.get(r.custom_id, "normal") != "normal"]
        slots = self._engine_window().for_chunk()
        try:
            outcomes = await asyncio.gather(
                self._run_normal(engine, [requests[n] for n in normal], slots),
                *(self._run_alone(engine, requests[n], plan[requests[n].custom_id]) for n in suspects),
            )
        finally:
            slots.settle(len(requests))
        # Realigned by position, not by id: a chunk may hold two lines with one custom_id (while ingest streams,
        # a duplicate runs before it is known to be one), and each row must keep its own answer.
        results: list[EngineResult] = [None] * len(requests)  # type: ignore[list-item]
        for n, result in zip([*normal, *suspects], [*outcomes[0], *outcomes[1:]], strict=True):
            results[n] = result
        lines = table.column("line").to_pylist()
        sources = table.column("source").to_pylist()
        models = table.column("model").to_pylist() if "model" in table.column_names else None
        return result_table(
            results, lines, sources, self.pool, self.job_id, leased_at, models=models, requests=requests
        )

    async def _run_lease(self, chunk: int, name: str, attempt: int, table: pa.Table) -> int:
        self.activity.begin()
        finished = None
        try:
            finished = await self.run_chunk(table, chunk, attempt)
        finally:
            tokens = (
                (_total(finished, "prompt_tokens"), _total(finished, "completion_tokens"))
                if finished is not None
                else (0, 0)
            )
            self.activity.end(table.num_rows, *tokens)
        # Staging is file or object-store I/O: off the event loop, which keeps feeding the engine meanwhile. A
        # thread cannot be stopped, so a ticket that ends early waits for it (`_settle`): a chunk is either staged
        # before its ticket ends or not at all.
        staging = asyncio.ensure_future(asyncio.to_thread(self.sink.stage, name, finished))
        self._staging.add(staging)
        staging.add_done_callback(self._staging.discard)
        staged = await asyncio.shield(staging)
        await self.queue.ack.remote(chunk, self.pool, staged)  # the queue tells the monitor
        # Reports are rate-limited, but the last one before the engine goes idle must go out: the manifest's
        # engine numbers (prefix-cache hits, preemptions) are read from the monitor when the job ends.
        self._report(force=self._in_flight == 0)
        return table.num_rows

    async def _lease(self, ticket: str) -> tuple[int, str, int, pa.Table] | None:
        return await self.queue.lease.remote(self.actor_id, ticket, self.chunk_rows)

    async def serve(self, ticket: str) -> int:
        """Lease chunks from the queue and run them until it is empty, holding about `window` requests inside
        the engine plus one chunk in reserve, so continuous batching stays full across chunk boundaries.
        Returns the chunks this ticket ran.

        The engine is built only once there is a chunk for it: engines start while ingest and fitting run (their
        process and imports overlap them), wait for their pool's plan — the engine args fitted to the measured
        input — and an engine that finds no work left never pays for building its engine."""
        plan = await self.queue.engine_plan.remote(self.pool)
        if plan is not None:
            self.spec, self.chunk_rows = plan.spec, plan.chunk_rows
        await self.queue.ticket_started.remote(ticket)  # a re-run ticket: its lost chunks come back first
        holding = 0  # rows leased and not yet staged
        running: dict[asyncio.Task, int] = {}
        first = await self._lease(ticket)
        if first is None:
            return 0
        await self._engine()
        window = self._engine_window()
        # Topped up by rows the engine has yet to run (see runtime/engines/inflight.py); rows held in all, finished ones
        # waiting for their chunk's slowest request included, keep a ceiling of HOLD_FACTOR times that.
        to_run_cap = (self.window or self.chunk_rows) + self.chunk_rows
        hold_cap = HOLD_FACTOR * to_run_cap
        asking: asyncio.Future | None = asyncio.get_running_loop().create_future()
        asking.set_result(first)
        try:
            return await self._pull(ticket, window, running, asking, holding, to_run_cap, hold_cap)
        finally:
            await self._settle(running)

    async def _settle(self, running: dict[asyncio.Task, int]) -> None:
        """A ticket that ends early (its engine failed a chunk, its job was stopped or is gone) stops its other
        chunks — their requests leave the engine — and waits for any chunk being staged, so nothing of the
        ticket is written after it ends."""
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await self._staged()

    async def _staged(self) -> None:
        """Until every chunk being staged is written. Shielded: a gather that is cancelled cancels what it waits
        for, and a cancelled staging task ends at once while its thread (which nothing stops) goes on writing."""
        await asyncio.gather(*(asyncio.shield(f) for f in list(self._staging)), return_exceptions=True)

    async def _pull(
        self,
        ticket: str,
        window: EngineWindow,
        running: dict[asyncio.Task, int],
        asking: asyncio.Future | None,
        holding: int,
        to_run_cap: int,
        hold_cap: int,
    ) -> int:
        topping_up: asyncio.Future | None = None
        exhausted = False
        chunks = 0
        while True:
            may_ask = asking is None and not exhausted and holding < hold_cap
            if may_ask and window.to_run < to_run_cap:
                asking = asyncio.ensure_future(self._lease(ticket))
            elif may_ask and topping_up is None:
                topping_up = asyncio.ensure_future(window.drops_below(to_run_cap))
            waiting = set(running) | {f for f in (asking, topping_up) if f is not None}
            if not running and asking is None:
                if topping_up is not None:
                    topping_up.cancel()
                return chunks
            try:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                if topping_up is not None:
                    topping_up.cancel()
                raise
            for task in done:
                if task is topping_up:
                    topping_up = None
                elif task is asking:
                    asking = None
                    lease = task.result()
                    if lease is None:
                        exhausted = True
                        continue
                    chunk, name, attempt, table = lease
                    holding += table.num_rows
                    window.leased(table.num_rows)
                    running[asyncio.ensure_future(self._run_lease(chunk, name, attempt, table))] = (
                        table.num_rows
                    )
                else:
                    holding -= running.pop(task)
                    task.result()  # a failure here is this engine's: the ticket re-runs on a fresh actor
                    chunks += 1

    async def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Ray Data hands this actor tickets (one per engine of the pool); each is a pull loop over the queue."""
        tickets = [str(t) for t in batch["ticket"].tolist()]
        ran = await asyncio.gather(*(self.serve(t) for t in tickets))
        self._report(force=True)
        return {"ticket": batch["ticket"], "chunks": np.asarray(ran, dtype=np.int64)}

    def __del__(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
        if self.engine is not None:
            self.engine.shutdown()
