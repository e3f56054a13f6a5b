"""The night window's arithmetic (pipeline/hours.py) on fixed instants, and the orchestration that runs a job inside
it (pipeline/runtime/hosting/shifts.py) with a fake clock (or the test clock of pipeline/clock.py) and a fake job."""

from __future__ import annotations

import datetime as dt

import pytest

from pipeline.clock import SkippingClock, WindowClosed
from pipeline.hours import Hours, HoursError
from pipeline.runtime.hosting.shifts import run_in_hours

UTC = dt.timezone.utc


def at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=UTC)


NIGHT = Hours.parse("22:00-06:00", "UTC")
DAY = Hours.parse("09:30-17:00", "UTC")


@pytest.mark.parametrize(
    "now, open_",
    [
        ("2025-03-10 21:59:59", False),
        ("2025-03-10 22:00:00", True),  # start is inside
        ("2025-03-10 23:59:59", True),
        ("2025-03-11 00:00:00", True),  # across midnight
        ("2025-03-11 05:59:59", True),
        ("2025-03-11 06:00:00", False),  # end is outside
        ("2025-03-11 12:00:00", False),
    ],
)
def test_a_window_that_wraps_midnight(now, open_):
    assert NIGHT.wraps and NIGHT.is_open(at(now)) is open_


@pytest.mark.parametrize(
    "now, open_",
    [
        ("2025-03-10 09:29", False),
        ("2025-03-10 09:30", True),
        ("2025-03-10 16:59", True),
        ("2025-03-10 17:00", False),
    ],
)
def test_a_window_within_one_day(now, open_):
    assert not DAY.wraps and DAY.is_open(at(now)) is open_


@pytest.mark.parametrize(
    "now, opens, closes",
    [
        # before the evening opening: tonight's window
        ("2025-03-10 12:00", "2025-03-10 22:00", "2025-03-11 06:00"),
        # open before midnight: closes tomorrow morning
        ("2025-03-10 23:00", "2025-03-10 23:00", "2025-03-11 06:00"),
        # open after midnight: it opened yesterday, closes this morning
        ("2025-03-11 01:00", "2025-03-11 01:00", "2025-03-11 06:00"),
        # just closed: the next opening is this evening
        ("2025-03-11 06:00", "2025-03-11 22:00", "2025-03-12 06:00"),
        # across a month and a year end
        ("2025-12-31 23:30", "2025-12-31 23:30", "2026-01-01 06:00"),
        ("2025-02-28 07:00", "2025-02-28 22:00", "2025-03-01 06:00"),
    ],
)
def test_next_open_and_closes_at_of_a_wrapping_window(now, opens, closes):
    assert NIGHT.next_open(at(now)) == at(opens)
    assert NIGHT.closes_at(at(now)) == at(closes)


@pytest.mark.parametrize(
    "now, opens, closes",
    [
        ("2025-03-10 08:00", "2025-03-10 09:30", "2025-03-10 17:00"),
        ("2025-03-10 10:00", "2025-03-10 10:00", "2025-03-10 17:00"),
        ("2025-03-10 17:00", "2025-03-11 09:30", "2025-03-11 17:00"),
        ("2025-03-10 23:59", "2025-03-11 09:30", "2025-03-11 17:00"),
    ],
)
def test_next_open_and_closes_at_within_one_day(now, opens, closes):
    assert DAY.next_open(at(now)) == at(opens)
    assert DAY.closes_at(at(now)) == at(closes)


def test_the_window_is_in_its_own_timezone():
    tokyo = Hours.parse("22:00-06:00", "Asia/Tokyo")  # UTC+9, no DST
    assert tokyo.is_open(at("2025-03-10 13:00"))  # 22:00 in Tokyo
    assert not tokyo.is_open(at("2025-03-10 12:59"))
    assert tokyo.closes_at(at("2025-03-10 13:00")) == at("2025-03-10 21:00")
    assert tokyo.next_open(at("2025-03-10 21:00")) == at("2025-03-11 13:00")
    # An instant given in another offset is the same instant.
    plus_two = dt.datetime(2025, 3, 10, 15, 0, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    assert tokyo.is_open(plus_two)


def test_without_a_timezone_the_window_is_local_time():
    hours = Hours.parse("22:00-06:00")
    local = dt.datetime(2025, 3, 10, 23, 0).astimezone()
    assert hours.is_open(local) and not hours.is_open(dt.datetime(2025, 3, 10, 12, 0).astimezone())
    assert hours.closes_at(local).astimezone().replace(tzinfo=None) == dt.datetime(2025, 3, 11, 6, 0)


@pytest.mark.parametrize(
    "text, timezone, problem",
    [
        ("22:00", None, "START-END"),
        ("22:00-06:00-07:00", None, "START-END"),
        ("24:00-06:00", None, "not a time of day"),
        ("22:60-06:00", None, "not a time of day"),
        ("ten-six", None, "not a time of day"),
        ("22:00-22:00", None, "same time"),
        ("22:00-06:00", "Mars/Olympus", "not a known timezone"),
    ],
)
def test_bad_windows_are_refused_with_what_to_give(text, timezone, problem):
    with pytest.raises(HoursError, match=problem):
        Hours.parse(text, timezone)


def test_window_is_none_without_hours_and_refuses_a_lone_timezone():
    from pipeline.hours import window

    assert window(None) is None and window("22:00-06:00", "UTC") == NIGHT
    with pytest.raises(HoursError, match="give --hours too"):
        window(None, "UTC")


@pytest.mark.parametrize(
    "hours, timezone",
    [("25:00-06:00", None), ("22:00", None), ("22:00-06:00", "Nowhere/Special"), (None, "UTC")],
)
def test_the_command_line_and_the_server_say_the_same_about_a_bad_window(tmp_path, hours, timezone):
    """One parser: `run --hours` and the server's hours setting fail with one message."""
    from typer.testing import CliRunner

    from pipeline.cli import app
    from pipeline.config import ConfigError
    from pipeline.hours import window
    from pipeline.server.settings import ServerConfig
    from tests.lines import chat_line, write_lines

    with pytest.raises(HoursError) as parsed:
        window(hours, timezone)
    with pytest.raises(ConfigError) as served:
        ServerConfig(hours=hours, timezone=timezone).check()
    assert str(served.value) == str(parsed.value)
    source = write_lines(tmp_path / "in.jsonl", [chat_line("a", "hi")])
    given = [*(["--hours", hours] if hours else []), *(["--timezone", timezone] if timezone else [])]
    result = CliRunner().invoke(app, ["run", str(source), str(tmp_path / "out"), "--engine", "fake", *given])
    assert result.exit_code == 2 and f"error: {parsed.value}" in result.output


def test_now_must_be_aware():
    with pytest.raises(ValueError, match="timezone-aware"):
        NIGHT.is_open(dt.datetime(2025, 3, 10, 23, 0))


# ------------------------------------------------------------------------------------------ orchestration


class FakeClock:
    """Time passes only when the job works or the orchestration waits; the alarm is remembered, and the fake job
    raises WindowClosed itself when its work would cross it (as the real alarm would interrupt it)."""

    def __init__(self, start: dt.datetime) -> None:
        self.t = start
        self.waits: list[tuple[dt.datetime, dt.datetime]] = []
        self.closes: dt.datetime | None = None

    def now(self) -> dt.datetime:
        return self.t

    def sleep_until(self, when: dt.datetime) -> None:
        self.waits.append((self.t, when))
        self.t = max(self.t, when)

    def alarm(self, when: dt.datetime):
        clock = self

        class Armed:
            def __enter__(self):
                clock.closes = when

            def __exit__(self, *exc):
                clock.closes = None

        return Armed()


class FakeJob:
    """A job of `rows` rows at one row a minute that keeps what it staged, like the real one (each attempt starts
    where the last staged row left off); rows in flight at the close are lost and run again."""

    def __init__(self, clock: FakeClock, rows: int) -> None:
        self.clock, self.rows = clock, rows
        self.staged: list[int] = []
        self.attempts: list[dt.datetime] = []

    def __call__(self) -> str:
        self.attempts.append(self.clock.now())
        while len(self.staged) < self.rows:
            done_at = self.clock.now() + dt.timedelta(minutes=1)
            if self.clock.closes is not None and done_at > self.clock.closes:
                self.clock.t = self.clock.closes
                raise WindowClosed
            self.clock.t = done_at
            self.staged.append(len(self.staged))
        return "committed"


def test_a_job_waits_for_the_window_runs_pauses_and_resumes_until_done():
    clock = FakeClock(at("2025-03-10 21:00"))
    job = FakeJob(clock, rows=10)
    released = []
    hours = Hours.parse("22:00-22:04", "UTC")
    assert run_in_hours(hours, job, clock, release=lambda: released.append(clock.now())) == "committed"
    # Waited for tonight's opening, worked 4 rows, stopped at the close, released, and so on each night.
    assert job.attempts == [at("2025-03-10 22:00"), at("2025-03-11 22:00"), at("2025-03-12 22:00")]
    assert released == [at("2025-03-10 22:04"), at("2025-03-11 22:04")]
    assert clock.waits[0] == (at("2025-03-10 21:00"), at("2025-03-10 22:00"))
    assert job.staged == list(range(10))  # every row once: nothing lost, nothing run twice
    assert clock.now() == at("2025-03-12 22:02")


def test_a_job_that_fits_in_the_window_runs_once_without_waiting():
    clock = FakeClock(at("2025-03-10 23:00"))
    job = FakeJob(clock, rows=3)
    assert run_in_hours(NIGHT, job, clock) == "committed"
    assert job.attempts == [at("2025-03-10 23:00")] and clock.waits == []


def test_an_error_of_the_job_is_not_a_window_close():
    clock = FakeClock(at("2025-03-10 23:00"))

    def broken() -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        run_in_hours(NIGHT, broken, clock)


def test_the_system_alarm_interrupts_the_main_thread():
    import time

    clock = SkippingClock(at("2025-03-10 22:03:59.8"))
    hours = Hours.parse("22:00-22:04", "UTC")
    calls = []

    def job() -> str:
        calls.append(clock.now())
        if len(calls) == 1:
            time.sleep(5)  # interrupted by the window's end, 0.2 s in
        return "committed"

    t0 = time.monotonic()
    assert run_in_hours(hours, job, clock) == "committed"
    assert time.monotonic() - t0 < 2
    # The second attempt came at the next opening, a day later on the skipping clock, without waiting for it.
    assert calls[1] - calls[0] > dt.timedelta(hours=23)


# ------------------------------------------------------------------------------------------ the command line


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--hours", "25:00-06:00"], "not a time of day"),
        (["--hours", "22:00-06:00", "--timezone", "Nowhere/Special"], "not a known timezone"),
        (["--timezone", "UTC"], "give --hours too"),
    ],
)
def test_run_refuses_a_bad_window_before_anything_starts(tmp_path, args, problem):
    from typer.testing import CliRunner

    from pipeline.cli import app
    from tests.lines import chat_line, write_lines

    source = write_lines(tmp_path / "in.jsonl", [chat_line("a", "hi")])
    result = CliRunner().invoke(app, ["run", str(source), str(tmp_path / "out"), "--engine", "fake", *args])
    assert result.exit_code != 0 and problem in result.output
    assert not (tmp_path / "out").exists()


def test_the_server_config_checks_its_window():
    from pipeline.config import ConfigError
    from pipeline.server.settings import ServerConfig

    assert ServerConfig(hours="22:00-06:00", timezone="UTC").window() == NIGHT
    assert ServerConfig().window() is None
    with pytest.raises(ConfigError, match="not a time of day"):
        ServerConfig(hours="22:00-30:00").check()
    with pytest.raises(ConfigError, match="give hours"):
        ServerConfig(timezone="UTC").check()


def test_the_runner_waits_for_the_window_and_expires_what_waited_too_long(tmp_path):
    """The server's runner outside its window: nothing starts; a queued batch past its completion_window ends
    `expired` (with nothing finished), one within it keeps waiting."""
    import time

    from pipeline.server.runner import BatchRunner, DataDir
    from pipeline.server.settings import ServerConfig
    from pipeline.server.store import Store

    data = DataDir(tmp_path)
    data.create()
    store = Store(data.database)
    now = int(time.time())
    store.add_batch("batch_old", "owner", "/v1/chat/completions", "file-x", "24h", None, 3, now - 1)
    store.add_batch("batch_new", "owner", "/v1/chat/completions", "file-x", "24h", None, 3, now + 3600)
    runner = BatchRunner(ServerConfig(hours="22:00-06:00", timezone="UTC"), store, data, None)
    runner.clock = FakeClock(at("2025-03-10 12:00"))  # closed until 22:00
    assert runner._closed_until() == at("2025-03-10 22:00")
    runner._queue[:] = [("batch_old", "owner"), ("batch_new", "owner")]
    runner._expire_queued()
    assert store.batch("batch_old").status == "expired" and store.batch("batch_old").expired_at
    assert store.batch("batch_new").status == "validating"
    assert runner._queue == [("batch_new", "owner")]
    runner.clock.t = at("2025-03-10 22:30")
    assert runner._closed_until() is None


# ------------------------------------------------------------------------------------- shifts as child processes


def _shift_job(tmp_path, monkeypatch, behaviour: str):  # noqa: ANN202 - ShiftJob
    """A ShiftJob whose children are the fake job (tests/fake_job_process.py)."""
    from pipeline.config import JobConfig
    from pipeline.runtime.hosting.shifts import ShiftJob
    from tests.fake_job_process import install_fake_python

    install_fake_python(
        tmp_path, monkeypatch, {"FAKE_RECORD": str(tmp_path / "record.jsonl"), "FAKE_BEHAVIOUR": behaviour}
    )
    job = JobConfig(input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out"))
    return ShiftJob(job, resume=False, flags=["--no-progress"])


def test_each_shift_runs_the_job_or_resumes_it_from_its_checkpoint(tmp_path, monkeypatch):
    import yaml

    from tests.fake_job_process import wait_for_records

    shift = _shift_job(tmp_path, monkeypatch, "exit:0")
    checkpointed = False
    monkeypatch.setattr(shift, "_checkpointed", lambda: checkpointed)
    assert shift() == 0  # the first shift: a new job, from its job file
    assert shift() == 0  # cut short before its checkpoint existed: run again, over what it left
    checkpointed = True
    assert shift() == 0  # resumed from the checkpoint
    first, second, third = wait_for_records(tmp_path / "record.jsonl", 3)
    assert first["argv"][:4] == ["-m", "pipeline", "run", "--config"] and first["argv"][-1] == "--no-progress"
    assert yaml.safe_load(first["job_file"])["overwrite"] is False
    assert yaml.safe_load(second["job_file"])["overwrite"] is True
    assert third["argv"] == ["-m", "pipeline", "resume", str(tmp_path / "out"), "--no-progress"]
    assert shift.shifts == 3


def test_a_closing_window_stops_the_shifts_child_and_the_next_opening_runs_it_again(
    tmp_path, monkeypatch, capfd
):
    """The window closes 4 s into the first shift (time for the child to start, on a busy machine too): its child
    gets SIGINT and ends by its abort path; the next opening (skipped to) starts the second shift, which finishes
    the job."""
    from tests.fake_job_process import wait_for_records

    shift = _shift_job(tmp_path, monkeypatch, "abort-once")
    clock = SkippingClock(at("2025-03-10 22:03:56"))
    released = []
    assert run_in_hours(Hours.parse("22:00-22:04", "UTC"), shift, clock, lambda: released.append(1)) == 0
    assert shift.shifts == 2 and released == [1]
    assert len(wait_for_records(tmp_path / "record.jsonl", 2)) == 2
    # The children write to this process's own stdout: the first one ended by its abort path.
    assert capfd.readouterr().out.count("interrupted; finished rows are kept") == 1
