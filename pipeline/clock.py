"""The clock the night window is read by (`pipeline/hours.py` is the window's arithmetic, on given instants): the
wall clock, whose alarm stops the main thread when the window closes, and a test clock. Both the shifts of
`nightshift run --hours` (runtime/hosting/shifts.py) and the server's runner (server/runner.py) take theirs from here.

`NIGHTSHIFT_TEST_CLOCK` (tests only) starts the clock at a given instant and makes waiting for a window skip ahead
instead of sleeping: a test sees a window close mid-job and reopen at once.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)

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
