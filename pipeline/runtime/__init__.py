"""The distributed job: the driver coordinates, the cluster does the per-row work.

    ingest/   read ─▶ validate ─▶ measure, as tasks on the cluster; duplicate ids by bucket; fit the engine args
    engines/  engine actors (one engine each) leasing chunks from the work queue and staging their own results;
              their monitor and warm keeper
    commit/   what a resume still has to run; range-partitioned shard tasks, then the manifest (the commit marker)
    hosting/  how the job's processes are hosted: the executor its tasks run through, the Ray session, the launcher
              that runs a job as a child process (the night window's shifts, the server), the warm runtime

Beside them: `job.py` (the order of the steps, on the driver, over the job's plan: pipeline/job_plan.py),
`preflight.py` (checks before any work), `locality.py` (the pin-to-driver rule) and `background.py` (a driver-side
thread helper).
"""
