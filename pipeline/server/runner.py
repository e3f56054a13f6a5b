"""Batches run as jobs of the runtime, one child process each: `nightshift run` for a new batch, `nightshift
resume` for one whose checkpoint exists (a restarted server), joined to the server's Ray cluster.

Why a child process and not a thread of the API replica: a job's driver must be stoppable — a cancel or an expired
window sends it SIGINT, and the job's own abort path releases its engines while every staged row stays on disk —
and a thread cannot be stopped. runtime/hosting/launcher.py starts and stops it: SIGINT, its grace, then SIGKILL. The child
dies with the thread that started it (PR_SET_PDEATHSIG), so a killed server leaves no orphan driving its batch; the
restarted server resumes it from the checkpoint.

With a night window (`hours`), batches start or resume only inside it; at its end a running batch's job gets the
same SIGINT (a batch already finalizing is let finish), the batch stays `in_progress` with the counts of its
checkpoint, and it goes back to the head of the queue to resume at the next opening. A batch whose
completion_window passes meanwhile, queued or running, ends `expired` with what finished.

Keys share the slots (`max_concurrent_batches`) in turns (server/scheduling.py): a batch whose key has had its turn
while another key's batch waits is paused the same way — SIGINT, rows kept, engines handed back warm — and queued
again; it resumes from its checkpoint at its key's next turn, on the engines the other key's batch leaves warm.

Engines stay warm between batches (`engine_idle_seconds`): the runner owns an engine keeper (runtime/engines/warm_keeper.py) and
every batch's job takes its engines from it; after a job's process ends, whatever of it still runs on them is
dropped before the batch gets its final status or is resumed. A closed window stops the idle ones at once.

Counts are read from the job's checkpoint (`_staging/`: rows staged so far) while it runs, and from its manifest once
it commits: request_counts are always rows that exist on disk.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from pipeline.clock import SystemClock, clock_from_environment
from pipeline.config import InputLimits, JobConfig
from pipeline.io.full_disk import EXIT_DISK_FULL, disk_full
from pipeline.io.staging import StagingArea
from pipeline.runtime.hosting.launcher import JobProcess, start_job
from pipeline.server import outputs, scheduling
from pipeline.server.accounting import account
from pipeline.server.datadir import fsync_tree, make_private
from pipeline.server.disk_use import tree_bytes
from pipeline.server.public_errors import public_message
from pipeline.server.quotas import Quotas
from pipeline.server.schemas import FINAL_STATUSES, BatchError, BatchObject
from pipeline.server.settings import ServerConfig
from pipeline.server.store import Store, new_id

log = structlog.get_logger(__name__)

# vLLM's per-request options for fetching and decoding media: a tenant's line could raise a fetch's timeout and size,
# or a processor's limits, on engines that other keys share.
TENANT_REFUSED_FIELDS = ("media_io_kwargs", "mm_processor_kwargs")
# A batch a full disk stopped is tried again after 5 s, then 10, 20, ... up to 5 min.
DISK_RETRY_FIRST_S = 5.0
DISK_RETRY_MAX_S = 300.0
# Why a running batch was stopped when its output grew past limits.max_output_bytes_per_batch: it ends `failed`.
OUTPUT_TOO_LARGE = "output_too_large"


def tenant_cache_salt(owner: str) -> str:
    """The prefix-cache namespace of an API key's requests (vLLM's cache_salt): a prompt prefix one key's batches
    put in an engine's cache is never a hit for another key's (a hit is a side channel: its timing and the cached
    token counts tell one tenant what another asked). `owner` is the key's id, never the key."""
    return "tenant-" + hashlib.sha256(owner.encode()).hexdigest()[:32]


class DataDir:
    """Where everything lives under the data dir; every path is built from server-made ids only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.database = root / "state.sqlite"
        self.files = root / "files"
        self.batches = root / "batches"
        self.scratch = root / "tmp"

    def create(self) -> None:
        for d in (self.files, self.batches, self.scratch):
            d.mkdir(parents=True, exist_ok=True)

    def upload(self, file_id: str) -> Path:
        return self.files / f"{file_id}.jsonl"

    def batch(self, batch_id: str) -> Path:
        return self.batches / batch_id

    def output(self, batch_id: str) -> Path:
        return self.batch(batch_id) / "output"


class BatchRunner:
    def __init__(
        self,
        config: ServerConfig,
        store: Store,
        data: DataDir,
        ray_address: str | None,
        quotas: Quotas | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.data = data
        self.ray_address = ray_address
        # Each key's running limit and weight (no labels given: every key has the defaults).
        self.quotas = quotas or Quotas(config.quotas, {})
        self._lock = threading.Condition()
        self._queue: list[tuple[str, str]] = []  # (batch_id, owner), oldest first
        self._running: dict[str, str] = {}  # batch_id -> owner
        self._turns: dict[str, _Turn] = {}  # running batch_id -> its turn
        self._last_turn: dict[str, float] = {}  # owner -> when its last turn began
        self._yielding: set[str] = set()  # running batches told to give their slot up
        self._procs: dict[str, JobProcess] = {}
        self._cancel: set[str] = set()
        # Batches held for room on the data dir's disk (`min_free_bytes`): their owners' /metrics say so.
        self.waiting_for_room: set[str] = set()
        self._disk_tries: dict[str, int] = {}  # batch -> times a full disk stopped it (its pause grows)
        self._stopping = False
        self.hours = config.window()
        self.clock = clock_from_environment() if self.hours else SystemClock()
        self._scheduler = threading.Thread(target=self._schedule, name="batch-scheduler", daemon=True)
        self.keeper: Any = None  # the warm-engine keeper (runtime/engines/warm_keeper.py), once started
        self.keeper_name = (
            f"nightshift-engines-{hashlib.sha256(str(data.root.resolve()).encode()).hexdigest()[:12]}"
        )

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Pick up what a previous server left unfinished, then start taking batches."""
        if self.config.engine_idle_seconds > 0:
            from pipeline.runtime.engines.warm_keeper import start_keeper

            self.keeper = start_keeper(self.keeper_name, self.config.engine_idle_seconds)
        for batch, owner in self.store.unfinished_batches():
            if batch.status == "cancelling":
                # Its job stopped with the old server; what it staged is what finished.
                self._finish_cut_short(batch.id, "cancelled")
            else:
                log.info("batch picked up after a restart", batch=batch.id, status=batch.status)
                self._queue.append((batch.id, owner))
        self._scheduler.start()

    def stop(self) -> None:
        """Server shutdown: stop the jobs without giving their batches a final status, so the next server
        resumes them. Returns once they have ended: each within its grace, else killed (the replica's Serve
        shutdown timeout is longer than the grace, server/app.py, so a replica stop lets it run out)."""
        with self._lock:
            self._stopping = True
            jobs = list(self._procs.values())
            self._lock.notify_all()
        for job in jobs:
            job.interrupt()
        for job in jobs:
            job.stop()
        if self.keeper is not None:
            import ray

            ray.kill(self.keeper)  # and its engines with it

    def submit(self, batch_id: str, owner: str) -> None:
        with self._lock:
            self._queue.append((batch_id, owner))
            self._lock.notify_all()

    def cancel(self, batch_id: str) -> None:
        """Mark the batch cancelling (done by the caller) and stop its work: a queued batch never starts, a
        running one's job gets SIGINT; both end `cancelled` with what finished."""
        with self._lock:
            queued = [q for q in self._queue if q[0] == batch_id]
            for q in queued:
                self._queue.remove(q)
            self._cancel.add(batch_id)
            job = self._procs.get(batch_id)
        if job is not None:
            job.interrupt()
        elif queued:
            try:
                self._finish_cut_short(batch_id, "cancelled")
            except Exception as exc:
                if not disk_full(exc):
                    raise
                # The store cannot take its end now: back in the queue, where the runner ends it (cancelled)
                # once there is room; the client's request is answered 507 and may be sent again.
                with self._lock:
                    self._queue.extend(queued)
                    self._lock.notify_all()
                raise

    # -- scheduling -------------------------------------------------------------------------------------------
    def _next(self) -> tuple[str, str] | None:
        """The batch to start now, in the keys' fair order (server/scheduling.py), or None."""
        if not self._queue or len(self._running) >= self.config.limits.max_concurrent_batches:
            return None
        picked = scheduling.pick(
            self._waiting(),
            self._turns_now(),
            self.config.limits.max_concurrent_batches,
            self._last_turn,
            lambda owner: self.quotas.of(owner).max_running_batches,
        )
        return (picked.batch_id, picked.owner) if picked else None

    def _waiting(self) -> list[scheduling.Waiting]:
        out = []
        for arrival, (batch_id, owner) in enumerate(self._queue):
            batch = self.store.batch(batch_id)
            out.append(scheduling.Waiting(batch_id, owner, batch.expires_at if batch else None, arrival))
        return out

    def _turns_now(self) -> list[scheduling.Running]:
        out = []
        now = time.monotonic()
        for batch_id, owner in self._running.items():
            turn = self._turns.get(batch_id)
            working = turn.working_since if turn is not None else None
            batch = self.store.batch(batch_id)
            can_yield = (
                working is not None
                and batch is not None
                and batch.status == "in_progress"  # not finalizing: a batch about to commit is let finish
            )
            out.append(
                scheduling.Running(
                    batch_id,
                    owner,
                    working if working is not None else now,
                    can_yield,
                    batch_id in self._yielding,
                )
            )
        return out

    def _turn_over(self, batch_id: str, batch: BatchObject | None) -> bool:
        """Whether this running batch should give its slot to another key's batch now (under the lock). Its turn
        counts from its first new rows: the job's own start (a resume's driver, ingest) is not the key's time."""
        turn = self._turns.get(batch_id)
        if (
            turn is not None
            and turn.working_since is None
            and batch is not None
            and _rows(batch) > turn.rows_then
        ):
            turn.working_since = time.monotonic()
        if self.config.limits.fair_share_seconds <= 0 or batch_id in self._yielding or not self._queue:
            return False
        due = scheduling.to_yield(
            self._waiting(),
            self._turns_now(),
            self.config.limits.max_concurrent_batches,
            self._last_turn,
            lambda owner: self.config.limits.fair_share_seconds * self.quotas.of(owner).weight,
            time.monotonic(),
            lambda owner: self.quotas.of(owner).max_running_batches,
        )
        if batch_id in due:
            self._yielding.add(batch_id)
            return True
        return False

    def _closed_until(self):  # noqa: ANN202 - datetime | None
        """None while work may run; else when the window opens next."""
        if self.hours is None:
            return None
        now = self.clock.now()
        return None if self.hours.is_open(now) else self.hours.next_open(now)

    def _expire_queued(self) -> None:
        """Queued batches (never started, or paused by the window) whose completion_window has passed."""
        now = time.time()
        for batch_id, owner in list(self._queue):
            batch = self.store.batch(batch_id)
            if batch is not None and batch.expires_at and now >= batch.expires_at:
                try:
                    self._finish_cut_short(batch_id, "expired")
                except Exception as exc:  # the scheduler must outlive a full store: it tries again later
                    if not disk_full(exc):
                        raise
                    log.warning("expired batch not ended: disk full", batch=batch_id)
                    continue
                self._queue.remove((batch_id, owner))

    def _schedule(self) -> None:
        announced = None
        while True:
            with self._lock:
                while True:
                    if self._stopping:
                        return
                    self._expire_queued()
                    opens = self._closed_until()
                    if opens is None and (picked := self._next()) is not None:
                        break
                    if opens is not None and announced != opens:
                        log.info(
                            "outside the window: batches wait",
                            hours=self.hours.describe(),
                            opens_at=str(opens),
                        )
                        announced = opens
                        if self.keeper is not None:
                            self.keeper.stop_idle.remote()  # the accelerators are the day's
                    if opens is not None and not self.clock.waits_in_real_time:
                        self.clock.sleep_until(opens)  # a test clock: skip ahead to the opening
                        continue
                    # Wake for the opening, and now and then to expire queued batches.
                    left = (opens - self.clock.now()).total_seconds() if opens is not None else None
                    timeout = (
                        min(max(left, 0.05), 30.0) if left is not None else (30.0 if self._queue else None)
                    )
                    self._lock.wait(timeout)
                self._queue.remove(picked)
                self._running[picked[0]] = picked[1]
                found = self.store.batch(picked[0])
                self._turns[picked[0]] = _Turn(rows_then=_rows(found) if found else 0)
                self._last_turn[picked[1]] = time.monotonic()
            threading.Thread(
                target=self._run, args=(picked[0],), name=f"batch-{picked[0]}", daemon=True
            ).start()

    # -- one batch --------------------------------------------------------------------------------------------
    def _job(self, batch_id: str, resume: bool) -> JobConfig:
        """The batch's job: the server's job with the batch's input, output and identity, on this cluster. A
        resumed one needs only where it runs: its checkpoint holds the rest."""
        job = self.config.job
        out = str(self.data.output(batch_id))
        resources = job.resources
        if self.ray_address is not None:  # the cluster this replica runs in
            resources = resources.model_copy(update={"address": self.ray_address})
        if resume:
            return job.model_copy(update={"output": out, "resources": resources})
        batch = self.store.batch(batch_id)
        assert batch is not None
        # A batch serves its one endpoint: a line for another route is that line's error record. Its requests share
        # the engines' prefix cache with its own key's batches only (warm engines serve every key).
        owner = self._running.get(batch_id)
        limits = self._batch_limits(batch).model_copy(
            update={"cache_salt": tenant_cache_salt(owner) if owner else None}
        )
        engine = job.engine
        if self.keeper is not None:
            engine = engine.model_copy(update={"warm_engines": self.keeper_name})
        return job.model_copy(
            update={
                "input": str(self.data.upload(batch.input_file_id)),
                "output": out,
                "job_id": batch_id,
                "overwrite": True,  # a first attempt cut short before its checkpoint existed may have left one
                "limits": limits,
                "engine": engine,
                "resources": resources,
            }
        )

    def _run(self, batch_id: str) -> None:
        paused: str | None = None
        try:
            paused = self._drive(batch_id)
        except Exception as exc:  # noqa: BLE001 - one batch's failure must not take the runner down
            if disk_full(exc):
                # The store or the disk could not take the batch's end (its status, its files' rows): not the
                # batch's failure. It goes back in the queue after a pause, waits for room and ends then — or
                # resumes.
                log.warning("batch not ended: disk full; it waits for room", batch=batch_id, error=str(exc))
                paused = self._disk_pause(batch_id)
            else:
                log.exception("batch runner failed", batch=batch_id)
                try:
                    self._fail(
                        batch_id,
                        "server_error",
                        f"{type(exc).__name__}: {exc}",
                        detail=traceback.format_exc(),
                    )
                except Exception as again:  # noqa: BLE001 - the store is full: its failure is recorded later
                    if not disk_full(again):
                        raise
                    paused = self._disk_pause(batch_id)
        finally:
            with self._lock:
                owner = self._running.pop(batch_id, None)
                self._procs.pop(batch_id, None)
                self._turns.pop(batch_id, None)
                self._yielding.discard(batch_id)
                if paused and owner is not None and not self._stopping:
                    # The window's end: first of its key's to resume at the next opening. A turn's end: behind
                    # what waits (the keys' order, not the queue's, decides who is next: server/scheduling.py).
                    where = 0 if paused == "window" else len(self._queue)
                    self._queue.insert(where, (batch_id, owner))
                self._lock.notify_all()

    def _drive(self, batch_id: str) -> str | None:
        """Run the batch's job to its end. Paused instead, the reason: "window" (the window's end: it resumes at
        the next opening) or "turn" (another key's turn: it resumes at its key's next)."""
        out = self.data.output(batch_id)
        self.data.batch(batch_id).mkdir(parents=True, exist_ok=True)
        cut_short: str | None = None
        paused: str | None = None
        pause_began = 0.0
        rc = 0
        waited = self._wait_for_room(batch_id)  # to start, resume or only record its end
        if waited == "stopping":
            return None
        cut_short = waited
        if cut_short is None and batch_id in self._cancel:  # cancelled while queued, its end not yet recorded
            cut_short = "cancelled"
        # Once, unless a full disk stopped its job: then again once there is room.
        while cut_short is None and not outputs.committed(out):
            resume = (out / "_staging" / "job.json").is_file()
            if not resume and self._fails_validation(batch_id):
                return False
            waited = self._wait_for_room(batch_id)
            if waited == "stopping":
                return None
            if waited is not None:
                cut_short = waited
                break
            job = start_job(
                self._job(batch_id, resume),
                resume=resume,
                job_file=self.data.batch(batch_id) / "job.yaml",
                flags=["--no-progress"],
                env=_ray_token_environment(),
                withhold=[self.config.auth.keys_env],  # the server's API keys, whatever the variable's name
                log_file=self.data.batch(batch_id) / "job.log",
            )
            log.info("batch job started", batch=batch_id, resumed=resume)
            with self._lock:
                self._procs[batch_id] = job
                if self._stopping:
                    job.interrupt()
            # Polled, not waited for: between polls the counts are read and the reasons to stop it checked. A job
            # told to stop that outlives its grace is killed inside wait().
            while (exit_code := job.wait(self.config.poll_seconds)) is None:
                self._observe(batch_id, out)
                batch = self.store.batch(batch_id)
                if cut_short is None and batch_id in self._cancel:
                    cut_short = "cancelled"
                if cut_short is None and batch and batch.expires_at and time.time() >= batch.expires_at:
                    cut_short = "expired"
                if (
                    cut_short is None
                    and batch is not None
                    and batch.status != "finalizing"  # its shards and checkpoint are both there a moment
                    and self._output_too_large(out)
                ):
                    cut_short = OUTPUT_TOO_LARGE
                if (
                    cut_short is None
                    and not paused
                    and self._closed_until() is not None
                    and batch is not None
                    and batch.status != "finalizing"  # nearly done: let it commit
                ):
                    paused = "window"
                    log.info(
                        "window closed: batch paused",
                        batch=batch_id,
                        completed=batch.request_counts.completed,
                    )
                if cut_short is None and not paused:
                    with self._lock:
                        turn_over = self._turn_over(batch_id, batch)
                    if turn_over:
                        paused = "turn"
                        log.info(
                            "another key's turn: batch paused",
                            batch=batch_id,
                            completed=batch.request_counts.completed if batch else None,
                        )
                if paused and not pause_began:
                    pause_began = time.monotonic()
                if cut_short or self._stopping or paused:
                    job.interrupt()  # once: the grace counts from the first
            rc = exit_code
            # A window's end frees the accelerators for the day; another key's turn takes the engines warm.
            self._drop_engines(batch_id, release_idle=paused == "window")
            if paused:
                log.info(
                    "batch stopped for its pause",
                    batch=batch_id,
                    reason=paused,
                    stopped_in_s=round(time.monotonic() - pause_began, 1),
                )
            if self._stopping:
                return None  # left unfinished on purpose: the next server resumes it
            if batch_id in self._cancel:
                cut_short = "cancelled"
            if paused and not cut_short and not outputs.committed(out):
                self._observe(batch_id, out)  # the counts it keeps while it waits: rows on disk
                return paused
            if rc == EXIT_DISK_FULL and not cut_short and not outputs.committed(out):
                # Its finished rows are staged: the batch pauses, waits for room (at the loop's top), then resumes.
                log.warning("disk full: batch waits for room to resume", batch=batch_id)
                self._disk_pause(batch_id)
                continue
            break
        if cut_short == OUTPUT_TOO_LARGE and not outputs.committed(out):
            limit = self.config.limits.max_output_bytes_per_batch
            self._fail(
                batch_id,
                "output_too_large",
                f"the batch's output passed this server's limit of {limit} bytes per batch "
                "(limits.max_output_bytes_per_batch): ask for fewer or shorter answers (max_tokens, n, logprobs), "
                "or split the input",
            )
        elif cut_short and not outputs.committed(out):
            self._finish_cut_short(batch_id, cut_short)
        elif outputs.committed(out):
            # Committed after all: the status is still why it was cut short (an expired batch stays expired).
            self._finish(batch_id, "completed" if cut_short in (None, OUTPUT_TOO_LARGE) else cut_short)
        else:
            self._fail(batch_id, "job_failed", _last_error(self.data.batch(batch_id) / "job.log", rc))
        return None

    def _drop_engines(self, batch_id: str, release_idle: bool) -> None:
        """The job's process has ended: whatever of it still runs on warm engines ends too (a killed job could
        not say so), before its rows are counted or it resumes. `release_idle`: the window closed — idle
        engines stop now, freeing their accelerators for the day."""
        if self.keeper is None:
            return
        import ray

        try:
            ray.get(self.keeper.drop_job.remote(batch_id), timeout=120)
            if release_idle:
                ray.get(self.keeper.stop_idle.remote(), timeout=60)
        except Exception as exc:  # noqa: BLE001 - the keeper went with a dying server; the next one resumes
            log.warning("warm engines not told the batch ended", batch=batch_id, error=str(exc))

    def _batch_limits(self, batch: BatchObject) -> InputLimits:
        """The job's limits for one batch: its one endpoint, and no line may set how media is fetched or decoded."""
        limits = self.config.job.limits
        refused = sorted({*limits.refused_fields, *TENANT_REFUSED_FIELDS})
        return limits.model_copy(update={"only_url": batch.endpoint, "refused_fields": refused})

    def _output_too_large(self, out: Path) -> bool:
        """Whether a running batch's output — its staged results and errors — passed
        limits.max_output_bytes_per_batch (the staged copy of its input is not output)."""
        limit = self.config.limits.max_output_bytes_per_batch
        if limit is None:
            return False
        staged = out / "_staging"
        return tree_bytes(staged / "results") + tree_bytes(staged / "errors") > limit

    def _wait_for_room(self, batch_id: str) -> str | None:
        """Hold the batch until its data dir has `min_free_bytes` free: a job started on a full disk would stop
        at its first write. None once there is room; else why it will not run: "cancelled", "expired" (it ends
        with what its checkpoint holds) or "stopping" (the server stops; the next one resumes it)."""
        try:
            return self._until_room(batch_id)
        finally:
            self.waiting_for_room.discard(batch_id)

    def _until_room(self, batch_id: str) -> str | None:
        said = False
        while True:
            free = shutil.disk_usage(self.data.root).free
            if free >= self.config.min_free_bytes:
                if said:
                    log.info("room on the disk again: batch resumes", batch=batch_id, free_bytes=free)
                return None
            # No room: what would end the batch's run ends its wait too.
            if batch_id in self._cancel:
                return "cancelled"
            batch = self.store.batch(batch_id)
            if batch is not None and batch.expires_at and time.time() >= batch.expires_at:
                return "expired"
            if self._stopping:
                return "stopping"
            self.waiting_for_room.add(batch_id)
            if not said:
                log.warning(
                    "batch waits for room on the disk",
                    batch=batch_id,
                    free_bytes=free,
                    needed=self.config.min_free_bytes,
                )
                said = True
            with self._lock:
                self._lock.wait(self.config.poll_seconds)

    def _observe(self, batch_id: str, out: Path) -> None:
        """Live counts and the status they imply, from the checkpoint. Best effort: a store that cannot take
        them now (a full disk) has them at the next poll."""
        try:
            self._count(batch_id, out)
        except Exception as exc:  # noqa: BLE001 - counting must never end a batch: its rows are on disk
            if not disk_full(exc):
                raise
            log.warning("batch counts not recorded: disk full", batch=batch_id)

    def _count(self, batch_id: str, out: Path) -> None:
        staging = StagingArea(out)
        try:
            state = staging.read_job()
        except Exception:  # noqa: BLE001 - not written yet, or being replaced: next poll
            return
        if not state.ingested or state.input is None:
            return
        try:
            completed, failed = staging.count("results"), staging.count("errors")
        except OSError:
            return  # the commit deleted `_staging/` between listing a part and reading it: the next poll counts
        except Exception as exc:  # noqa: BLE001 - a count is best effort: it must never fail the batch
            log.warning("batch counts not read", batch=batch_id, error=str(exc))
            return
        # Staged rows are only ever added — until the commit deletes `_staging/` under a poll's feet (the final counts
        # are then the manifest's): counts never go back.
        batch = self.store.batch(batch_id)
        if batch is not None:
            completed = max(completed, batch.request_counts.completed)
            failed = max(failed, batch.request_counts.failed)
        now = int(time.time())
        total = state.input.lines
        self.store.update_batch(batch_id, total=total, completed=completed, failed=failed)
        # While it runs, the batch names the job's own model; once it ends, the one its lines ran on (_account).
        model = state.model.name if state.model else None
        self.store.update_batch(
            batch_id, only_if=("validating",), status="in_progress", in_progress_at=now, model=model
        )
        if completed + failed >= total:
            self.store.update_batch(
                batch_id, only_if=("in_progress",), status="finalizing", finalizing_at=now
            )

    def _output_files(self, batch_id: str) -> tuple[list[dict[str, Any]], dict[str, str | None]]:
        """The batch's output and error files as file rows, and the batch's columns that name them; written
        together with its final status (Store.finish_batch). What they point at is made private and durable first:
        its job's processes may have written it with another umask, and none of them fsyncs its directory."""
        out = self.data.output(batch_id)
        make_private(self.data.batch(batch_id))
        if out.is_dir():
            fsync_tree(out)
        rows: list[dict[str, Any]] = []
        ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for kind, column, label in (
            ("results", "output_file_id", "output"),
            ("errors", "error_file_id", "error"),
        ):
            if outputs.output_rows(out, kind):
                file_id = new_id("file-")
                rows.append(
                    {
                        "id": file_id,
                        "filename": f"{batch_id}_{label}.jsonl",
                        "purpose": "batch_output",
                        "bytes": outputs.output_bytes(out, kind),
                        "batch_id": batch_id,
                        "kind": kind,
                    }
                )
                ids[column] = file_id
        return rows, ids

    def _finish(self, batch_id: str, status: str) -> None:
        out = self.data.output(batch_id)
        now = int(time.time())
        completed, failed = outputs.output_rows(out, "results"), outputs.output_rows(out, "errors")
        batch = self.store.batch(batch_id)
        assert batch is not None
        stamps = {"finalizing_at": batch.finalizing_at or now, "in_progress_at": batch.in_progress_at or now}
        files, ids = self._output_files(batch_id)
        if self.store.finish_batch(
            batch_id,
            files,
            status=status,
            total=completed + failed,
            completed=completed,
            failed=failed,
            **stamps,
            **{f"{status}_at": now},
            **ids,
            **self._account(batch_id),
        ):
            log.info("batch finished", batch=batch_id, status=status, completed=completed, failed=failed)

    def _finish_cut_short(self, batch_id: str, status: str) -> None:
        """Cancelled or expired before its output was committed: what the checkpoint holds is what finished."""
        out = self.data.output(batch_id)
        batch = self.store.batch(batch_id)
        if batch is None or batch.status in FINAL_STATUSES:
            return
        completed, failed = outputs.output_rows(out, "results"), outputs.output_rows(out, "errors")
        files, ids = self._output_files(batch_id)
        if self.store.finish_batch(
            batch_id,
            files,
            status=status,
            completed=completed,
            failed=failed,
            **{f"{status}_at": int(time.time())},
            **ids,
            **self._account(batch_id),
        ):
            log.info("batch cut short", batch=batch_id, status=status, completed=completed, failed=failed)

    def _disk_pause(self, batch_id: str) -> str:
        """A batch a full disk stopped waits before it is tried again, longer each time (5 s doubling to 5 min):
        free space above `min_free_bytes` does not prove its next write fits (a quota, inodes, a bigger
        finalize), and the queue would hand it over again at once. Returns the pause's reason, "disk"."""
        tries = self._disk_tries.get(batch_id, 0)
        self._disk_tries[batch_id] = tries + 1
        with self._lock:
            if not self._stopping:
                self._lock.wait(min(DISK_RETRY_FIRST_S * 2**tries, DISK_RETRY_MAX_S))
        return "disk"

    def _fail(self, batch_id: str, code: str, message: str, detail: str | None = None) -> None:
        """The batch fails with `message` as its owner may read it (server/public_errors.py); the whole text —
        and `detail`, a traceback — goes to the batch's job.log for the operator."""
        job_log = self.data.batch(batch_id) / "job.log"
        try:
            with open(job_log, "a") as f:
                f.write(f"server: batch failed ({code}): {message}\n{detail or ''}")
        except OSError as exc:
            log.warning("batch failure not written to its job.log", batch=batch_id, error=str(exc))
        self.store.finish_batch(
            batch_id,
            [],
            status="failed",
            failed_at=int(time.time()),
            errors=[BatchError(code=code, message=public_message(message, self.data.root))],
            **self._account(batch_id),
        )

    def _account(self, batch_id: str) -> dict[str, Any]:
        """The batch's `usage` and `model` as it ends (server/accounting.py): its manifest's, else what its
        checkpoint staged. Never in the way of its final status: unreadable, they stay unset."""
        try:
            found = account(self.data.output(batch_id))
        except Exception as exc:  # noqa: BLE001 - accounting is a report, not a reason to leave a batch unfinished
            log.warning("batch usage not read", batch=batch_id, error=str(exc))
            return {}
        return {"usage": found.usage, **({"model": found.model} if found.model else {})}

    def _fails_validation(self, batch_id: str) -> bool:
        """limits.line_errors fail_batch: the batch's input through the job's validator before any of it runs, as
        OpenAI validates a batch; True when a line is invalid and the batch has ended `failed`, its errors naming
        the lines (OpenAI's shape: code, message, line) — or `cancelled`, when a cancel came meanwhile."""
        if self.config.limits.line_errors != "fail_batch":
            return False
        from pipeline.server.linecheck import MAX_LISTED_ERRORS, invalid_lines, served_before_run

        batch = self.store.batch(batch_id)
        assert batch is not None
        limits = self._batch_limits(batch)
        path = self.data.upload(batch.input_file_id)
        errors, invalid, lines = invalid_lines(path, served_before_run(self.config.job), limits)
        if not invalid:
            return False
        if invalid > MAX_LISTED_ERRORS:
            errors.append(
                BatchError(
                    code="too_many_invalid_lines",
                    message=f"{invalid} of {lines} lines are invalid; the first {MAX_LISTED_ERRORS} are listed",
                )
            )
        failed = self.store.update_batch(
            batch_id,
            only_if=("validating",),
            status="failed",
            failed_at=int(time.time()),
            total=lines,
            errors=errors,
            **self._account(batch_id),  # nothing ran: zeros
        )
        if failed:
            log.info("batch failed validation", batch=batch_id, invalid=invalid, lines=lines)
        elif batch_id in self._cancel:  # cancelled while it was validated: it ends so, nothing run
            self._finish_cut_short(batch_id, "cancelled")
        return True


@dataclass
class _Turn:
    """A running batch's turn on the engines."""

    rows_then: int  # rows it had on disk when the turn began
    working_since: float | None = None  # when its first new rows of the turn were seen (monotonic)


def _rows(batch: BatchObject) -> int:
    """Rows a batch has on disk (its live counts: finished results and errors)."""
    return batch.request_counts.completed + batch.request_counts.failed


def _ray_token_environment() -> dict[str, str]:
    """What the job's environment needs beyond this replica's to join this cluster with the token this replica's
    Ray uses. A token given to the cluster (the environment, or nightshift's head token) the job finds itself; a
    private local Ray (`nightshift serve` without --address) keeps Ray's own default token file, which the job must
    be pointed at (nightshift does not read it implicitly: see cluster/auth.py)."""
    from cluster.auth import TOKEN_ENV, TOKEN_PATH_ENV, default_token_path

    ray_default = Path.home() / ".ray" / "auth_token"
    if (
        not (os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_PATH_ENV) or default_token_path().is_file())
        and ray_default.is_file()
    ):
        return {TOKEN_PATH_ENV: str(ray_default)}
    return {}


def _last_error(log_path: Path, rc: int) -> str:
    """The job's own one-line reason (`error: …`, what `nightshift run` prints last), else its exit code."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in reversed(lines):
        if line.startswith("error: "):
            return line[len("error: ") :]
    return f"the job exited with code {rc}"
