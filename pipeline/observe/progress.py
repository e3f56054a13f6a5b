"""Live job progress: rows done/total, output tok/s, ETA — a rich bar on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field

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


class ProgressDisplay:
    """A rich progress bar when stderr is a terminal; otherwise a log line every `log_every` seconds."""

    def __init__(self, counters: JobCounters, enabled: bool = True, log_every: float = 10.0) -> None:
        self.counters = counters
        self.interactive = enabled and sys.stderr.isatty()
        self.log_every = log_every
        self._last_log = 0.0
        self._progress = None
        self._task = None

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
                TextColumn("{task.fields[pools]}"),
                console=Console(stderr=True),
                transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(
                "run", total=self.counters.total, tps=0.0, failed=0, pools=""
            )
        return self

    def update(self, force: bool = False, pools: dict[str, dict] | None = None) -> None:
        c = self.counters
        per_pool = pool_line(pools, time.monotonic() - c.started) if pools and len(pools) > 1 else ""
        if self._progress is not None:
            tps = c.output_tokens_per_second()
            self._progress.update(self._task, completed=c.done, tps=tps, failed=c.failed, pools=per_pool)
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
                **({"pools": per_pool} if per_pool else {}),
            )

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self.update()
            self._progress.__exit__(*exc)
