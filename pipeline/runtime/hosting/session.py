"""The Ray session a job runs in: start a private instance or join a cluster, quietly, with the settings Ray Data
needs for a batch job. Runs on the driver."""

from __future__ import annotations

# How long a job's private instance keeps a task worker that has nothing to do. Ray's default (1 s) ends ingest's
# workers as soon as ingest is done, and finalize then waits for fresh ones to start and import again: 1.1–1.9 s of a
# short job's tail on a 2-core box, against 0.55 s on the workers ingest left. Five minutes keeps them for the jobs
# whose tail that is (a long job's workers go, and their memory with them, five minutes after ingest).
IDLE_TASK_WORKERS_KEPT_MS = 300_000


def start_ray(address: str | None, keep_idle_workers: bool = False) -> None:
    """Join the cluster at `address`, or start a private instance (None or "local"). `keep_idle_workers`: a private
    instance that serves one job keeps idle task workers for finalize (IDLE_TASK_WORKERS_KEPT_MS); one that outlives
    jobs (the Batch API server, `nightshift up`) keeps Ray's default, so workers of past jobs do not hold memory."""
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
            kept = keep_idle_workers and address in (None, "local")
            ray.init(
                address=address or "local",
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.ERROR,
                # A cluster's settings are its own; a private instance's for one job are that job's.
                _system_config={"idle_worker_killing_time_threshold_ms": IDLE_TASK_WORKERS_KEPT_MS}
                if kept
                else None,
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
    # A map's own exception reaches the driver, not Ray Data's generic "UDF failed to process a data block" whose
    # cause is lost on the way: the driver tells a full disk (pipeline/io/full_disk.py) by what was raised.
    ctx.raise_original_map_exception = True


def end_ray() -> None:
    """Disconnect from Ray; a private instance this process started ends with it, a second sooner than
    `ray.shutdown()` alone ends it.

    Shutdown stops a private instance's processes one after another, each with SIGTERM and up to a second to exit.
    The autoscaler's monitor never makes it: on SIGTERM it tries to report its own end to the GCS, which shutdown
    has already stopped, and is killed after the full second (1.0 of the 1.4 s shutdown takes on a 2-core box).
    A single-node private instance has nothing to autoscale, so its monitor is killed outright first; the rest
    stop as before. A driver connected to a cluster started no process: it only disconnects."""
    import contextlib
    import subprocess
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    from ray._private import ray_constants, worker

    node = getattr(worker, "_global_node", None)
    for info in (getattr(node, "all_processes", None) or {}).get(ray_constants.PROCESS_TYPE_MONITOR, []):
        if info.process.poll() is None:
            info.process.kill()
            # One stuck in the kernel is left to shutdown, which reaps what it can.
            with contextlib.suppress(subprocess.TimeoutExpired):
                info.process.wait(timeout=2)
    ray.shutdown()
