"""The job's recorder: the one observer the runtime calls. It takes what the driver already reads — the running
counters, the work queues' per-pool totals, the engines' pushed numbers — and keeps it as the timeline (observe/
timeline.py, saved under `_staging/` for `status`, the report and a resumed job) and, with a metrics port, serves
it to Prometheus (observe/metrics.py).

Observers never drive the job: every method takes numbers and returns nothing the runtime acts on, and a failure
to save or serve is logged, never raised into the job.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from pipeline.observe.timeline import TIMELINE_NAME, Timeline, engine_sample

log = structlog.get_logger(__name__)

SAMPLE_EVERY_S = 2.0  # the engines push every ~2 s: sampling faster would record the same numbers twice
SAVE_EVERY_S = (
    10.0  # how stale `_staging/timeline.json` may get (`status` calls a job older than this interrupted)
)


class JobRecorder:
    def __init__(
        self, files: Any = None, staging_root: str | None = None, info: dict[str, str] | None = None
    ):
        """`files`/`staging_root`: where the timeline is kept (a StagingArea's files and root); None keeps it in
        memory only (unit tests)."""
        self.files = files
        self.path = f"{staging_root}/{TIMELINE_NAME}" if staging_root else None
        self.info = info or {}
        self.timeline = Timeline()
        self.metrics = None
        self._last_sample = float("-inf")
        self._last_save = float("-inf")
        # Totals of earlier runs of a resumed job: this run's queues count from zero, the timeline across runs.
        self._offset = {"prompt_tokens": 0, "completion_tokens": 0}
        # The report's charts will be drawn (observe/report.py): their library is imported once results come in,
        # while the engines run, not after the last one; not before, when engines starting need every core.
        self.charts_wanted = False
        self._done_at_first_sample: int | None = None

    @classmethod
    def for_staging(cls, staging: Any, info: dict[str, str]) -> JobRecorder:
        recorder = cls(staging.files, staging.root, info)
        recorder.load()
        return recorder

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def load(self) -> None:
        """A resumed job's history, if it has one."""
        if self.path is None or not self.files.exists(self.path):
            return
        try:
            self.timeline = Timeline.from_json(self.files.read_bytes(self.path))
        except (ValueError, OSError) as exc:  # an unreadable history is lost, the job is not
            log.warning("job timeline unreadable; starting a new one", error=str(exc))
            return
        if self.timeline.last:
            for key in self._offset:
                self._offset[key] = self.timeline.last.get(key, 0)

    def serve_metrics(self, port: int) -> int:
        """Start /metrics; raises OSError when the port cannot be bound (the caller says what to change)."""
        from pipeline.observe.metrics import MetricsServer

        self.metrics = MetricsServer(self, port)
        return self.metrics.port

    def run_started(self) -> None:
        self.timeline.run_started()
        self.save()

    def stage_started(self, name: str) -> None:
        self.timeline.stage_started(name)
        self.save()

    def stage_ended(self, name: str) -> None:
        self.timeline.stage_ended(name)
        self.save()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    # -- samples -----------------------------------------------------------------------------------------------
    def sample(
        self,
        counters: Any,
        pools: dict[str, dict[str, Any]],
        engines: dict[str, dict[str, Any]],
        retried_requests: Callable[[], int] | int = 0,
        force: bool = False,
    ) -> None:
        """Record the job now: `counters` (observe.progress.JobCounters), the queues' per-pool totals, the monitor's
        raw per-engine reports, and requests retried (a callable is asked only when a sample is taken: it may be an actor
        call). Rate-limited to one sample per SAMPLE_EVERY_S unless `force`."""
        now = time.monotonic()
        if not force and now - self._last_sample < SAMPLE_EVERY_S:
            return
        self._last_sample = now
        if callable(retried_requests):
            try:
                retried_requests = retried_requests()
            except Exception as exc:  # noqa: BLE001 - a slow or restarting monitor: the last count stands
                log.debug("retries unavailable", error=str(exc))
                retried_requests = (self.timeline.last or {}).get("retried_requests", 0)
        if self._done_at_first_sample is None:
            self._done_at_first_sample = counters.done  # a resumed job's earlier rows, or lines found invalid
        if self.charts_wanted and counters.done > self._done_at_first_sample:
            self.charts_wanted = False
            from pipeline.observe.report import preload_charts

            preload_charts()
        eta = counters.eta_seconds()
        self.timeline.total_rows = counters.total
        self.timeline.add(
            {
                "t": round(time.time(), 3),
                "rows_total": counters.total,
                "rows_done": counters.done,
                "rows_failed": counters.failed,
                "prompt_tokens": self._offset["prompt_tokens"] + counters.prompt_tokens,
                "completion_tokens": self._offset["completion_tokens"] + counters.completion_tokens,
                "output_tokens_per_s": round(counters.output_tokens_per_second(), 2),
                "eta_s": None if eta is None else round(eta, 1),
                "pools": {
                    name: {k: int(stats.get(k) or 0) for k in ("rows", "prompt_tokens", "completion_tokens")}
                    for name, stats in pools.items()
                },
                "engines": {actor: engine_sample(info) for actor, info in engines.items()},
                "retried_requests": retried_requests,
            }
        )
        if force or now - self._last_save >= SAVE_EVERY_S:
            self.save()

    def save(self) -> None:
        self._last_save = time.monotonic()
        if self.path is None:
            return
        self.timeline.updated_at = time.time()
        try:
            self.files.write_bytes(self.path, self.timeline.to_json())
        except Exception as exc:  # noqa: BLE001 - the history is a view of the job, never a reason to stop it
            log.warning("job timeline not saved", error=str(exc))
