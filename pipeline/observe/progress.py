"""Live job progress: rows done/total, output tok/s, ETA, and the engines' own numbers (KV cache usage,
preemptions, prefix-cache hit rate) — a rich bar on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

log = structlog.get_logger(__name__)

RATE_WINDOW_S = 30.0


@dataclass
class JobCounters:
    """Running totals the driver keeps as results stream back."""

    total: int
    done: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    first_result_at: float | None = None
    _samples: deque = field(default_factory=deque, repr=False)

    def add_invalid(self, rows: int) -> None:
        """Lines rejected before any engine ran: done and failed, but no tokens and no generation time."""
        self.done += rows
        self.failed += rows

    def add(self, rows: int, failed: int, prompt_tokens: int, completion_tokens: int) -> None:
        now = time.monotonic()
        if self.first_result_at is None and rows:
            self.first_result_at = now
        self.done += rows
        self.failed += failed
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self._samples.append((now, self.completion_tokens, self.done))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _rate(self, index: int) -> float | None:
        # Over a recent window, not since the start: engine start-up is not generation speed, and results
        # arrive in bursts (one Ray task at a time), so a rate over a single burst would be meaningless.
        if len(self._samples) < 2:
            return None
        (t0, *first), (t1, *last) = self._samples[0], self._samples[-1]
        if t1 - t0 < 1.0:
            return None
        return (last[index] - first[index]) / (t1 - t0)

    def output_tokens_per_second(self) -> float:
        return self._rate(0) or 0.0

    def eta_seconds(self) -> float | None:
        rate = self._rate(1)
        return (self.total - self.done) / rate if rate else None


def pool_line(pools: dict[str, dict], elapsed: float) -> str:
    """'cuda 1200 rows 310 tok/s | rocm 640 rows 150 tok/s' — how the work splits across pools, live."""
    parts = []
    for name, stats in sorted(pools.items()):
        tps = stats["completion_tokens"] / elapsed if elapsed > 0 else 0.0
        parts.append(f"{name} {stats['rows']} rows {tps:.0f} tok/s")
    return " | ".join(parts)


class EngineNumbers(Protocol):
    """What the display reads of the engines' summary (runtime/engines/monitor.py `EngineSummary`)."""

    @property
    def kv_cache_usage(self) -> float | None: ...
    @property
    def kv_cache_usage_peak(self) -> float | None: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def prefix_cache_hit_rate(self) -> float | None: ...


def engine_line(engines: EngineNumbers | None) -> str:
    """'KV 63% (peak 97%) · 12 preemptions · prefix hits 66%' — the engines' numbers, as far as they are known."""
    if engines is None:
        return ""
    parts = []
    if engines.kv_cache_usage is not None:
        peak = engines.kv_cache_usage_peak
        parts.append(f"KV {engines.kv_cache_usage:.0%}" + (f" (peak {peak:.0%})" if peak is not None else ""))
    if engines.num_preemptions:
        parts.append(f"{engines.num_preemptions} preemptions")
    if engines.prefix_cache_hit_rate is not None:
        parts.append(f"prefix hits {engines.prefix_cache_hit_rate:.0%}")
    return " · ".join(parts)


def engine_fields(engines: EngineNumbers | None) -> dict[str, Any]:
    """The engines' numbers as log-line fields (only those known)."""
    if engines is None:
        return {}
    fields = {
        "kv_cache_usage": engines.kv_cache_usage,
        "kv_cache_usage_peak": engines.kv_cache_usage_peak,
        "preemptions": engines.num_preemptions,
        "prefix_cache_hit_rate": engines.prefix_cache_hit_rate,
    }
    return {k: v for k, v in fields.items() if v is not None}


class ProgressDisplay:
    """A rich progress bar when stderr is a terminal; otherwise a log line every `log_every` seconds.

    With `engines` (a callable returning the engines' summary, see runtime.monitor.EngineWatch), a ticker thread
    calls it and refreshes the display every `tick` seconds: results arrive a batch at a time, and a batch of long
    generations can take minutes, during which the KV cache fills and preemptions start.
    """

    def __init__(
        self,
        counters: JobCounters,
        enabled: bool = True,
        log_every: float = 10.0,
        engines: Callable[[], EngineNumbers | None] | None = None,
        tick: float = 2.0,
    ) -> None:
        self.counters = counters
        self.interactive = enabled and sys.stderr.isatty()
        self.log_every = log_every
        self.engines = engines
        self.tick = tick
        self._last_log = 0.0
        self._progress = None
        self._task = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._pools: dict[str, dict] | None = None
        self._engines_summary: EngineNumbers | None = None

    def _tick(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                # Polled here only, outside the display lock: the result loop never waits on the monitor.
                self._engines_summary = self.engines()
                self.update()
            except Exception:  # noqa: BLE001 - a display must never take the job down
                log.debug("progress refresh failed", exc_info=True)

    def __enter__(self) -> ProgressDisplay:
        if self.interactive:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]nightshift"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("rows"),
                TextColumn("{task.fields[tps]:>8.1f} tok/s"),
                TextColumn("failed {task.fields[failed]}"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[engine]}"),
                TextColumn("{task.fields[pools]}"),
                console=Console(stderr=True),
                transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(
                "run", total=self.counters.total, tps=0.0, failed=0, engine="", pools=""
            )
        if self.engines is not None:
            self._ticker = threading.Thread(target=self._tick, name="nightshift-progress", daemon=True)
            self._ticker.start()
        return self

    def update(self, force: bool = False, pools: dict[str, dict] | None = None) -> None:
        with self._lock:
            if pools is not None:
                self._pools = pools
            self._update(force)

    def _update(self, force: bool) -> None:
        c = self.counters
        pools = self._pools
        per_pool = pool_line(pools, time.monotonic() - c.started) if pools and len(pools) > 1 else ""
        engines = self._engines_summary
        if self._progress is not None:
            tps = c.output_tokens_per_second()
            self._progress.update(
                self._task,
                completed=c.done,
                tps=tps,
                failed=c.failed,
                engine=engine_line(engines),
                pools=per_pool,
            )
            return
        now = time.monotonic()
        if force or now - self._last_log >= self.log_every:
            self._last_log = now
            eta = c.eta_seconds()
            log.info(
                "progress",
                rows_done=c.done,
                rows_total=c.total,
                failed=c.failed,
                output_tok_per_s=round(c.output_tokens_per_second(), 1),
                eta_s=None if eta is None else round(eta, 1),
                **engine_fields(engines),
                **({"pools": per_pool} if per_pool else {}),
            )

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=self.tick + 5)
        if self._progress is not None:
            self.update()
            self._progress.__exit__(*exc)
