"""A job inside the night window (`nightshift run --hours`): wait for the window, run, and when it closes stop the
job the way Ctrl-C does — its abort path releases the engines, every staged row stays in `_staging/`, the rows in
flight are dropped and run again later — then wait for the next opening and resume, all from the one command,
until the job commits. Resuming re-runs only rows without a staged result, so the output is the uninterrupted
run's. Each shift's job is a child process, started and stopped by runtime/launcher.py (`ShiftJob`).

The window's arithmetic is `pipeline/hours.py`; the clock is injected, so the orchestration is tested with a fake
one and a fake job. `NIGHTSHIFT_TEST_CLOCK` (tests only) starts the clock at a given instant and makes waiting
for a window skip ahead instead of sleeping: a test sees a window close mid-job and reopen at once.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import structlog

from pipeline.hours import Hours
from pipeline.runtime.launcher import start_job

if TYPE_CHECKING:
    from pipeline.config import JobConfig

log = structlog.get_logger(__name__)

T = TypeVar("T")

TEST_CLOCK_ENV = "NIGHTSHIFT_TEST_CLOCK"


class WindowClosed(KeyboardInterrupt):
    """Raised in the main thread when the window ends. A KeyboardInterrupt, so the job takes exactly the path a
    Ctrl-C takes (nothing on the way catches it as an ordinary error)."""


class Clock(Protocol):
    def now(self) -> dt.datetime: ...

    def sleep_until(self, when: dt.datetime) -> None: ...

    def alarm(self, when: dt.datetime) -> AbstractContextManager[None]: ...


class SystemClock:
    """The wall clock; the alarm is SIGALRM, so it interrupts the main thread wherever it waits, as SIGINT does."""

    waits_in_real_time = True  # a waiter may as well block on its own condition until the opening

    def now(self) -> dt.datetime:
        return dt.datetime.now(dt.timezone.utc)

    def sleep_until(self, when: dt.datetime) -> None:
        # In steps, so a suspended laptop or a changed clock is noticed within a minute.
        while (left := (when - self.now()).total_seconds()) > 0:
            time.sleep(min(left, 60.0))

    @contextmanager
    def alarm(self, when: dt.datetime) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the window's alarm needs the main thread (signals are delivered there)")

        def ring(signum: int, frame: object) -> None:
            raise WindowClosed

        previous = signal.signal(signal.SIGALRM, ring)
        signal.setitimer(signal.ITIMER_REAL, max((when - self.now()).total_seconds(), 0.001))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


class SkippingClock(SystemClock):
    """Tests only: starts at `start` and runs at the wall clock's pace, but waiting for a window jumps ahead."""

    waits_in_real_time = False

    def __init__(self, start: dt.datetime) -> None:
        self._offset = start - dt.datetime.now(dt.timezone.utc)

    def now(self) -> dt.datetime:
        return dt.datetime.now(dt.timezone.utc) + self._offset

    def sleep_until(self, when: dt.datetime) -> None:
        self._offset += max(when - self.now(), dt.timedelta(0))


def clock_from_environment() -> Clock:
    start = os.environ.get(TEST_CLOCK_ENV)
    if not start:
        return SystemClock()
    when = dt.datetime.fromisoformat(start)
    if when.tzinfo is None:
        raise ValueError(f"{TEST_CLOCK_ENV}={start!r} needs a UTC offset, e.g. 2025-01-01T21:59:50+00:00")
    log.warning("test clock in use: waiting for the window skips ahead", starts_at=start)
    return SkippingClock(when)


def run_in_hours(
    hours: Hours,
    attempt: Callable[[], T],
    clock: Clock,
    release: Callable[[], None] = lambda: None,
) -> T:
    """Call `attempt` (one run or resume of the job) inside the window until it returns; each time the window
    closes first, `attempt` is stopped by WindowClosed, `release` frees what it held, and the next opening
    starts it again."""
    shifts = 0
    while True:
        now = clock.now()
        if not hours.is_open(now):
            opens = hours.next_open(now)
            log.info("outside the window: waiting", hours=hours.describe(), opens_at=opens.isoformat())
            clock.sleep_until(opens)
            continue
        closes = hours.closes_at(now)
        shifts += 1
        log.info("window open: working", hours=hours.describe(), closes_at=closes.isoformat(), shift=shifts)
        try:
            with clock.alarm(closes):
                return attempt()
        except WindowClosed:
            log.info(
                "window closed: job stopped, finished rows kept; it resumes when the window opens again",
                hours=hours.describe(),
                opens_at=hours.next_open(clock.now()).isoformat(),
            )
            release()


class ShiftJob:
    """One job, run shift after shift, each shift as a child `nightshift run` / `nightshift resume` process
    (runtime/launcher.py: why a child, and how it is started and stopped).

    A child per shift because when the window closes, the job's engines must be gone before anything resumes it,
    and a child's exit guarantees that (its Ray driver ends, and Ray ends the driver's actors; a private local Ray
    ends with it).
    """

    def __init__(self, job: JobConfig, resume: bool, flags: list[str]) -> None:
        self.job = job
        self.resume = resume  # the first shift continues an interrupted job (`nightshift resume --hours`)
        self.flags = flags  # passed to every shift's command (--no-progress, --token-file …)
        self.shifts = 0

    def _checkpointed(self) -> bool:
        from pipeline.io.writers import output_target

        try:
            output_target(self.job.output, self.job.storage).staging_area().read_job()
        except Exception:  # noqa: BLE001 - no job.json (yet): nothing to resume
            return False
        return True

    def __call__(self) -> int:
        """Run one shift; its exit code (0: the job committed). WindowClosed stops the child first."""
        with tempfile.TemporaryDirectory(prefix="nightshift-shift-") as workdir:
            resume = self.resume or bool(self.shifts and self._checkpointed())
            job = self.job
            if self.shifts and not resume:
                # An earlier shift was cut short before its checkpoint existed: what it left in OUTPUT is its own.
                job = job.model_copy(update={"overwrite": True})
            self.shifts += 1
            child = start_job(job, resume=resume, job_file=Path(workdir) / "job.yaml", flags=self.flags)
            try:
                return child.wait()
            except KeyboardInterrupt:
                if child.poll() == 0:
                    return 0  # the job committed just as the window closed: done, nothing to stop or resume
                # The window closed (or Ctrl-C, which the child, in our process group, received too): let its
                # abort path end it; what it staged is kept.
                child.stop()
                raise
