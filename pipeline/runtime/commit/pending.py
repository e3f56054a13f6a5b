"""What a resumed job still has to run: its work list without the requests engines already staged a row for.

An anti-join on custom_id, done by Ray Data over the staged parts (hash-partitioned across the cluster, written back
as the pending work list under `_staging/pending/`), so the driver never holds the finished ids of a job that may
have a hundred million: it reads only the parts' row counts. Where the staging directory is on the driver's disk and
the cluster spans hosts (tasks elsewhere could not read it), the driver filters the work list itself; so it does
for a small job (at most DRIVER_FILTER_ROWS requests), whose finished ids fit in a few MB while the join's fixed
cost — its shuffle actors start — is seconds (20 s on a busy 2-core box), paid by every resume of a small batch.

A fresh job has nothing finished: its work list is used as it is, with no Ray Data job at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from pipeline.io.staging import StagingArea
from pipeline.runtime.locality import must_pin_to_driver

log = structlog.get_logger(__name__)

ROWS_PER_PARTITION = 1_000_000  # the join's partitions: each holds about this many ids at once
DRIVER_FILTER_ROWS = 100_000  # a work list this small is filtered by the driver (a bounded set of ids)


@dataclass(frozen=True)
class PendingWork:
    files: list[str]  # the work list still to run
    finished_rows: int  # rows engines staged in earlier runs


def pending_work(staging: StagingArea, valid: int) -> PendingWork:
    """`valid`: the requests in the work list."""
    done_parts = staging.engine_parts()
    if not done_parts:
        return PendingWork(staging.request_files(), 0)
    finished_rows = staging.num_rows(done_parts)
    if finished_rows >= valid:
        return PendingWork([], finished_rows)
    if valid <= DRIVER_FILTER_ROWS or _driver_only(staging):
        return PendingWork(staging.pending_requests(set(staging.finished_ids())), finished_rows)
    return PendingWork(_anti_join(staging, done_parts), finished_rows)


def _driver_only(staging: StagingArea) -> bool:
    import ray

    if not ray.is_initialized():
        return True
    driver = ray.get_runtime_context().get_node_id()
    return must_pin_to_driver(staging.is_local, ray.nodes(), driver)


def _anti_join(staging: StagingArea, done_parts: list[str]) -> list[str]:
    import ray

    requests = staging.request_files()
    if not requests:
        return []
    fs = staging.files.arrow_filesystem()
    rows = staging.num_rows(requests)
    work = ray.data.read_parquet(requests, filesystem=fs)
    done = ray.data.read_parquet(done_parts, filesystem=fs).select_columns(["custom_id"])
    left = work.join(
        done,
        join_type="left_anti",
        num_partitions=max(1, -(-rows // ROWS_PER_PARTITION)),
        on=("custom_id",),
    )
    staging.files.delete_tree(staging.pending_dir)  # an earlier resume's list, now out of date
    staging.files.makedirs(staging.pending_dir)
    left.write_parquet(staging.pending_dir, filesystem=fs)
    files = staging.files.list_parts(staging.pending_dir)
    log.info("pending work listed on the cluster", parts=len(files), finished_parts=len(done_parts))
    return files
