"""The distributed job: the driver coordinates, the cluster does the per-row work.

    ingest/   read ─▶ validate ─▶ measure, as tasks on the cluster; duplicate ids by bucket; fit the engine args
    engines/  engine actors (one engine each) leasing chunks from the work queue; their monitor and warm keeper
    stage/    each engine actor stages its own results; what a resume still has to run
    commit/   range-partitioned shard tasks, then the manifest (the commit marker)

Beside them: `job.py` (the order of the steps, on the driver), `session.py` (start or join Ray), `preflight.py`
(checks before any work), `shifts.py` (the night window), `launcher.py` (a job as a child process, for the night
window and the server), `locality.py` (the pin-to-driver rule) and `background.py` (a driver-side thread helper).
"""
