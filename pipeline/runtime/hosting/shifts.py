"""A job inside the night window (`nightshift run --hours`): wait for the window, run, and when it closes stop the
job the way Ctrl-C does — its abort path releases the engines, every staged row stays in `_staging/`, the rows in
flight are dropped and run again later — then wait for the next opening and resume, all from the one command,
until the job commits. Resuming re-runs only rows without a staged result, so the output is the uninterrupted
run's. Each shift's job is a child process, started and stopped by runtime/hosting/launcher.py (`ShiftJob`).

The window's arithmetic is `pipeline/hours.py`, its clock `pipeline/clock.py` (the wall clock, or the test clock
`NIGHTSHIFT_TEST_CLOCK` starts); the clock is injected, so the orchestration is tested with a fake one and a fake
job.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import structlog

from pipeline.clock import Clock, WindowClosed
from pipeline.hours import Hours
from pipeline.runtime.hosting.launcher import start_job

if TYPE_CHECKING:
    from pipeline.config import JobConfig

log = structlog.get_logger(__name__)

T = TypeVar("T")


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
    (runtime/hosting/launcher.py: why a child, and how it is started and stopped).

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
