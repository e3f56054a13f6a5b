"""Prometheus metrics of a running job (`nightshift run --metrics-port N`), served by the driver.

Every value comes from the job's latest sample (observe/timeline.py), which the driver takes from what it already
reads: nothing here asks the cluster for anything, and a scrape costs no actor call. Running totals are exported as
counters (rate() gives tok/s over any window); what is true at an instant (in-flight requests, KV usage, the recent
tok/s the progress bar shows) as gauges. Labels are bounded: `pool`, and `engine` (one per engine actor, a few per
pool across restarts) — never a request's custom_id. `METRICS` lists every name exported; the Grafana dashboard
(pipeline/observe/grafana-dashboard.json) may use only these (tests/unit/test_metrics.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from pipeline.observe.timeline import STAGES, Timeline

# name (as exposed) -> (type, help). Counters keep their `_total` suffix here, as Prometheus shows them.
METRICS: dict[str, tuple[str, str]] = {
    "nightshift_job_info": ("gauge", "The job: id, model, engine backend (value 1)."),
    "nightshift_input_rows": ("gauge", "Input rows (lines) of the job, once ingest has counted them."),
    "nightshift_rows_done_total": ("counter", "Rows finished: results and error records."),
    "nightshift_rows_failed_total": ("counter", "Rows that became error records."),
    "nightshift_eta_seconds": ("gauge", "Estimated seconds until every row is done (recent rate)."),
    "nightshift_output_tokens_per_second": ("gauge", "Completion tokens per second over the last ~30 s."),
    "nightshift_pool_rows_total": ("counter", "Rows a pool's engines staged."),
    "nightshift_pool_prompt_tokens_total": ("counter", "Prompt tokens of the rows a pool staged."),
    "nightshift_pool_completion_tokens_total": ("counter", "Completion tokens of the rows a pool staged."),
    "nightshift_engine_rows_total": ("counter", "Rows an engine finished."),
    "nightshift_engine_prompt_tokens_total": ("counter", "Prompt tokens of the rows an engine finished."),
    "nightshift_engine_completion_tokens_total": ("counter", "Completion tokens an engine generated."),
    "nightshift_engine_requests_in_flight": ("gauge", "Requests inside an engine now (running or waiting)."),
    "nightshift_engine_kv_cache_usage_ratio": ("gauge", "An engine's KV cache usage, 0..1 (last reading)."),
    "nightshift_engine_preemptions_total": ("counter", "Sequences an engine preempted (KV cache full)."),
    "nightshift_engine_prefix_cache_queries_total": ("counter", "Prefix-cache lookups of an engine, tokens."),
    "nightshift_engine_prefix_cache_hits_total": ("counter", "Prefix-cache hits of an engine, tokens."),
    "nightshift_engines": ("gauge", "Engine actors that reported, per pool."),
    "nightshift_engine_restarts_total": (
        "counter",
        "Engine actors Ray restarted (their engine or node died).",
    ),
    "nightshift_requests_retried_total": ("counter", "Requests started more than once after an engine died."),
    "nightshift_stage_active": ("gauge", "1 while the stage runs (ingest, fit, engines, finalize), else 0."),
    "nightshift_stage_duration_seconds": ("gauge", "Seconds the stage has run (so far, or in all)."),
}


def _family(name: str, labels: list[str]) -> CounterMetricFamily | GaugeMetricFamily:
    kind, help_text = METRICS[name]
    if kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), help_text, labels=labels)
    return GaugeMetricFamily(name, help_text, labels=labels)


def families(
    sample: dict[str, Any] | None, timeline: Timeline, info: dict[str, str], now: float
) -> list[CounterMetricFamily | GaugeMetricFamily]:
    """The metric families of one moment of the job (a pure function of what the driver recorded)."""
    out = {}

    def fam(name: str, labels: list[str] | None = None):
        if name not in out:
            out[name] = _family(name, labels or [])
        return out[name]

    job = fam("nightshift_job_info", sorted(info))
    job.add_metric([info[k] for k in sorted(info)], 1)
    active, duration = (
        fam("nightshift_stage_active", ["stage"]),
        fam("nightshift_stage_duration_seconds", ["stage"]),
    )
    for stage in STAGES:
        span = timeline.stages.get(stage)
        running = bool(span and span.get("end") is None)
        active.add_metric([stage], 1 if running else 0)
        if span:
            duration.add_metric([stage], max(0.0, (span.get("end") or now) - span["start"]))
    if sample is None:
        return list(out.values())
    if sample.get("rows_total") is not None:
        fam("nightshift_input_rows").add_metric([], sample["rows_total"])
    fam("nightshift_rows_done_total").add_metric([], sample["rows_done"])
    fam("nightshift_rows_failed_total").add_metric([], sample["rows_failed"])
    fam("nightshift_output_tokens_per_second").add_metric([], sample.get("output_tokens_per_s") or 0.0)
    if sample.get("eta_s") is not None:
        fam("nightshift_eta_seconds").add_metric([], sample["eta_s"])
    for pool, stats in sorted((sample.get("pools") or {}).items()):
        fam("nightshift_pool_rows_total", ["pool"]).add_metric([pool], stats.get("rows", 0))
        fam("nightshift_pool_prompt_tokens_total", ["pool"]).add_metric([pool], stats.get("prompt_tokens", 0))
        fam("nightshift_pool_completion_tokens_total", ["pool"]).add_metric(
            [pool], stats.get("completion_tokens", 0)
        )
    engines_per_pool: dict[str, int] = {}
    restarts = 0
    for engine, e in sorted((sample.get("engines") or {}).items()):
        labels = [e.get("pool") or "", engine]
        engines_per_pool[labels[0]] = engines_per_pool.get(labels[0], 0) + 1
        restarts += 1 if e.get("restarted") else 0
        for name, key in (
            ("nightshift_engine_rows_total", "rows"),
            ("nightshift_engine_prompt_tokens_total", "prompt_tokens"),
            ("nightshift_engine_completion_tokens_total", "completion_tokens"),
            ("nightshift_engine_requests_in_flight", "in_flight"),
            ("nightshift_engine_preemptions_total", "preemptions"),
            ("nightshift_engine_prefix_cache_queries_total", "prefix_cache_queries"),
            ("nightshift_engine_prefix_cache_hits_total", "prefix_cache_hits"),
        ):
            fam(name, ["pool", "engine"]).add_metric(labels, e.get(key) or 0)
        if e.get("kv_cache_usage") is not None:
            fam("nightshift_engine_kv_cache_usage_ratio", ["pool", "engine"]).add_metric(
                labels, e["kv_cache_usage"]
            )
    for pool, n in sorted(engines_per_pool.items()):
        fam("nightshift_engines", ["pool"]).add_metric([pool], n)
    fam("nightshift_engine_restarts_total").add_metric([], restarts)
    fam("nightshift_requests_retried_total").add_metric([], sample.get("retried_requests") or 0)
    return list(out.values())


class JobCollector(Collector):
    """Reads the recorder's latest sample at scrape time."""

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        import time

        yield from families(
            self.recorder.timeline.last, self.recorder.timeline, self.recorder.info, time.time()
        )


class MetricsServer:
    """The /metrics endpoint on `port` (all interfaces: Prometheus scrapes the driver's host)."""

    def __init__(self, recorder: Any, port: int, addr: str = "0.0.0.0") -> None:
        from prometheus_client import start_http_server

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(JobCollector(recorder))
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if isinstance(self._thread, threading.Thread):
            self._thread.join(timeout=5)
