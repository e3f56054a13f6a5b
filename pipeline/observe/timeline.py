"""The job's history: a bounded series of samples and the times of its stages, kept in `_staging/timeline.json`.

The driver samples what it already reads every ~2 s (rows and tokens from the work queues, each engine's pushed
numbers); the report charts it, `nightshift status` reads throughput, ETA and liveness from it. Samples hold
running totals, never rates, so thinning the series (every other sample, when it outgrows MAX_SAMPLES) keeps every
total exact and only coarsens the rates read between samples. A resumed job loads the file and keeps appending:
its history spans every run.

A pure module (no Ray): the runtime hands it numbers, it never asks for any.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

TIMELINE_NAME = "timeline.json"
MAX_SAMPLES = 720  # ~24 min at full resolution; a night-long job keeps 720 samples (~40 s apart at 8 h)
STAGES = ("ingest", "fit", "engines", "finalize")


def engine_sample(info: dict[str, Any]) -> dict[str, Any]:
    """One engine's numbers as the timeline keeps them, from its monitor report (runtime/engines/engine_actor.py `_report`)."""
    stats = info.get("stats") or {}
    activity = info.get("activity") or {}
    return {
        "pool": info.get("pool"),
        "in_flight": info.get("requests_inside") or 0,
        "kv_cache_usage": stats.get("kv_cache_usage"),
        "preemptions": stats.get("num_preemptions") or 0,
        "prefix_cache_queries": stats.get("prefix_cache_queries") or 0,
        "prefix_cache_hits": stats.get("prefix_cache_hits") or 0,
        "rows": activity.get("rows") or 0,
        "prompt_tokens": activity.get("prompt_tokens") or 0,
        "completion_tokens": activity.get("completion_tokens") or 0,
        "restarted": bool(info.get("restarted")),
    }


@dataclass
class Timeline:
    """Samples (running totals at a wall-clock time) and stage spans (epoch seconds)."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    stages: dict[str, dict[str, float | None]] = field(default_factory=dict)
    runs: list[float] = field(default_factory=list)  # when each run of the job (the first, each resume) began
    total_rows: int | None = None
    updated_at: float | None = None  # the driver's last write: how `status` tells running from interrupted
    max_samples: int = MAX_SAMPLES

    # -- recording ---------------------------------------------------------------------------------------------
    def run_started(self, now: float | None = None) -> None:
        self.runs.append(time.time() if now is None else now)

    def stage_started(self, name: str, now: float | None = None) -> None:
        # A stage redone on resume keeps its first start: the timeline shows the job, not just this run.
        span = self.stages.setdefault(name, {"start": time.time() if now is None else now, "end": None})
        span["end"] = None

    def stage_ended(self, name: str, now: float | None = None) -> None:
        span = self.stages.setdefault(name, {"start": time.time() if now is None else now, "end": None})
        span["end"] = time.time() if now is None else now

    def add(self, sample: dict[str, Any]) -> None:
        self.samples.append(sample)
        if len(self.samples) > self.max_samples:
            # Every other sample, the last always kept: totals stay exact, rates get coarser evenly.
            last = self.samples[-1]
            self.samples = self.samples[:-1:2] + [last]

    @property
    def last(self) -> dict[str, Any] | None:
        return self.samples[-1] if self.samples else None

    # -- reading ---------------------------------------------------------------------------------------------
    def rate(self, key: str, window_s: float = 60.0) -> float | None:
        """`key` per second over the last `window_s` of samples (None with fewer than two, or no time between)."""
        if len(self.samples) < 2:
            return None
        last = self.samples[-1]
        first = next((s for s in self.samples if last["t"] - s["t"] <= window_s), self.samples[-2])
        if first is last:
            first = self.samples[-2]
        span = last["t"] - first["t"]
        return (last[key] - first[key]) / span if span > 0 else None

    # -- persistence ---------------------------------------------------------------------------------------------
    def to_json(self) -> bytes:
        data = {
            "samples": self.samples,
            "stages": self.stages,
            "runs": self.runs,
            "total_rows": self.total_rows,
            "updated_at": self.updated_at,
        }
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Timeline:
        raw = json.loads(data)
        return cls(
            samples=list(raw.get("samples") or []),
            stages=dict(raw.get("stages") or {}),
            runs=list(raw.get("runs") or []),
            total_rows=raw.get("total_rows"),
            updated_at=raw.get("updated_at"),
        )


def rates(samples: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(times, per-second rate of `key`) between consecutive samples; the time of a rate is its interval's end."""
    times, values = [], []
    for before, after in zip(samples, samples[1:], strict=False):
        span = after["t"] - before["t"]
        if span > 0:
            times.append(after["t"])
            values.append(max(0.0, (after.get(key, 0) - before.get(key, 0)) / span))
    return times, values
