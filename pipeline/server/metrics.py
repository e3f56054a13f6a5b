"""The Batch API server's `GET /metrics`: the metric names a job's driver exports (pipeline/observe/metrics.py), one
set per unfinished batch of the caller's, each sample labelled with its `batch` id; plus the caller's batches by
status (`nightshift_server_batches`), the files and bytes it holds on disk, by purpose
(`nightshift_server_stored_files`, `nightshift_server_stored_bytes`), and how many of its batches wait for room on a
full disk (`nightshift_server_batches_waiting_for_disk`).

A batch's job runs in a child process; what it has done is read from the job's own timeline
(`_staging/timeline.json`, which its driver saves every ~2 s), so a scrape never asks a job anything. Owner-scoped
like every other route: a key sees only its own batches, here too. Labels stay bounded: only unfinished batches are
exported (a few at a time: the runner's `max_concurrent_batches` and its queue)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from pipeline.observe.metrics import families
from pipeline.observe.timeline import TIMELINE_NAME, Timeline
from pipeline.server.schemas import BatchObject

BATCHES_METRIC = "nightshift_server_batches"
STORED_FILES_METRIC = "nightshift_server_stored_files"
STORED_BYTES_METRIC = "nightshift_server_stored_bytes"
WAITING_FOR_DISK_METRIC = "nightshift_server_batches_waiting_for_disk"
# Every purpose is exported, held or not, so a dashboard sees a zero rather than a gap.
PURPOSES = ("batch", "batch_output")


def _timeline(output: Path) -> Timeline | None:
    path = output / "_staging" / TIMELINE_NAME
    try:
        return Timeline.from_json(path.read_bytes())
    except (OSError, ValueError):  # not written yet, or being replaced: this scrape shows none for the batch
        return None


def _labelled(family: Metric, batch_id: str) -> Metric:
    """The family with `batch` added to each sample's labels."""
    copy = type(family)(family.name, family.documentation, labels=[])  # type: ignore[call-arg]
    for sample in family.samples:
        copy.samples.append(sample._replace(labels={**sample.labels, "batch": batch_id}))
    return copy


def batch_families(
    counts: dict[str, int], unfinished: list[BatchObject], output_of: Any, now: float | None = None
) -> list[Metric]:
    """The metric families of the caller's batches (a pure function of the store's rows and the jobs' timelines):
    `counts` by status, and each unfinished batch's job metrics; `output_of(batch_id)` is where its job writes."""
    now = time.time() if now is None else now
    by_status = GaugeMetricFamily(BATCHES_METRIC, "The caller's batches, by status.", labels=["status"])
    for status, n in sorted(counts.items()):
        by_status.add_metric([status], n)
    merged: dict[str, Metric] = {}
    for batch in unfinished:
        timeline = _timeline(Path(output_of(batch.id)))
        if timeline is None:  # queued, or its driver has not saved a sample yet
            continue
        info = {"job_id": batch.id, "endpoint": batch.endpoint}
        for family in families(timeline.last, timeline, info, now):
            labelled = _labelled(family, batch.id)
            if labelled.name in merged:
                merged[labelled.name].samples.extend(labelled.samples)
            else:
                merged[labelled.name] = labelled
    return [by_status, *merged.values()]


def storage_families(stored: dict[str, tuple[int, int]]) -> list[Metric]:
    """The caller's files whose bytes are on disk, per purpose: `stored` is purpose -> (files, bytes), the store's
    `stored_by_purpose` (deleted uploads a running batch still reads included, until it ends)."""
    files = GaugeMetricFamily(
        STORED_FILES_METRIC, "The caller's files held on disk, by purpose.", labels=["purpose"]
    )
    size = GaugeMetricFamily(
        STORED_BYTES_METRIC, "Bytes of the caller's files held on disk, by purpose.", labels=["purpose"]
    )
    for purpose in sorted({*PURPOSES, *stored}):
        n, held = stored.get(purpose, (0, 0))
        files.add_metric([purpose], n)
        size.add_metric([purpose], held)
    return [files, size]


def waiting_families(waiting: int) -> list[Metric]:
    """How many of the caller's batches wait for room on the server's disk to start or resume."""
    family = GaugeMetricFamily(
        WAITING_FOR_DISK_METRIC,
        "The caller's batches waiting for room on the server's disk (min_free_bytes) to start or resume; their "
        "finished rows stay staged.",
    )
    family.add_metric([], waiting)
    return [family]


class _Collector(Collector):
    def __init__(self, found: list[Metric]) -> None:
        self.found = found

    def collect(self):  # noqa: ANN201 - prometheus_client's protocol
        yield from self.found


def exposition(
    counts: dict[str, int], unfinished: list[BatchObject], output_of: Any, extra: list[Metric] | None = None
) -> bytes:
    """The Prometheus text format of `batch_families`, and of `extra` families."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector([*batch_families(counts, unfinished, output_of), *(extra or [])]))
    return generate_latest(registry)
