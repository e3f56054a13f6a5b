"""The job-process launcher (pipeline/runtime/launcher.py) with a fake child (tests/fake_job_process.py) that
records what it was given (its arguments, its environment, the job file) and then behaves as told — exits, aborts
on SIGINT as a job does, or ignores SIGINT as a stuck job would."""

from __future__ import annotations

import signal
import stat
import time
from pathlib import Path

import pytest
import yaml

from pipeline.config import JobConfig
from pipeline.runtime.launcher import STOP_GRACE_SECONDS, start_job
from tests.fake_job_process import install_fake_python, wait_for_records

pytestmark = pytest.mark.timeout(60)

SECRET = "sk-test-very-secret-token-0123456789"


@pytest.fixture
def fake_python(tmp_path, monkeypatch) -> Path:
    return install_fake_python(tmp_path, monkeypatch)


def _job(tmp_path: Path, **http) -> JobConfig:
    return JobConfig.model_validate(
        {
            "input": str(tmp_path / "in.jsonl"),
            "output": str(tmp_path / "out"),
            "engine": {"backend": "http", "http": {"endpoints": ["http://127.0.0.1:9"], **http}},
            "resources": {"address": "10.0.0.1:6379"},
            "storage": {"s3_region": "eu-west-1"},
        }
    )


def _env(tmp_path: Path, behaviour: str) -> dict[str, str]:
    return {"FAKE_RECORD": str(tmp_path / "record.jsonl"), "FAKE_BEHAVIOUR": behaviour}


def _start(tmp_path: Path, behaviour: str, job: JobConfig | None = None, resume: bool = False, **options):  # noqa: ANN202 - JobProcess
    """The job (by default a plain one) started with the fake child behaving as `behaviour`."""
    job = job or _job(tmp_path)
    return start_job(
        job, resume=resume, job_file=tmp_path / "job.yaml", env=_env(tmp_path, behaviour), **options
    )


def _record(tmp_path: Path) -> dict:
    return wait_for_records(tmp_path / "record.jsonl", 1)[0]


def test_there_is_one_grace_and_the_server_replica_waits_longer_than_it():
    from pipeline.server.app import BatchAPI

    assert STOP_GRACE_SECONDS == 60.0
    assert BatchAPI._deployment_config.graceful_shutdown_timeout_s > STOP_GRACE_SECONDS


def test_a_new_job_runs_from_its_job_file_with_the_secret_only_in_its_environment(tmp_path, fake_python):
    job = _job(tmp_path, api_key=SECRET, api_key_env="MY_ENDPOINT_KEY")
    job_file = tmp_path / "job.yaml"
    child = _start(tmp_path, "exit:0", job, flags=["--no-progress"])
    assert child.wait() == 0
    seen = _record(tmp_path)
    assert seen["argv"] == ["-m", "pipeline", "run", "--config", str(job_file), "--no-progress"]
    assert seen["env"]["MY_ENDPOINT_KEY"] == SECRET
    assert not any(SECRET in arg for arg in seen["argv"])
    assert SECRET not in seen["job_file"] and SECRET not in job_file.read_text()
    # The job file is the job, naming the variable the child reads the key from; its owner's only.
    written = yaml.safe_load(job_file.read_text())
    assert written["engine"]["http"]["api_key_env"] == "MY_ENDPOINT_KEY"
    assert written["engine"]["http"].get("api_key") is None
    reread = JobConfig.model_validate(written)
    assert reread.model_copy(update={"engine": job.engine}) == job
    assert stat.S_IMODE(job_file.stat().st_mode) == 0o600


def test_a_job_without_a_named_variable_gets_its_key_under_the_default_one(tmp_path, fake_python):
    job = _job(tmp_path, api_key=SECRET, api_key_env=None)
    child = _start(tmp_path, "exit:0", job)
    assert child.wait() == 0
    seen = _record(tmp_path)
    assert seen["env"]["NIGHTSHIFT_API_KEY"] == SECRET
    assert yaml.safe_load(seen["job_file"])["engine"]["http"]["api_key_env"] == "NIGHTSHIFT_API_KEY"


def test_a_resumed_job_is_named_by_its_output_and_still_gets_its_secret(tmp_path, fake_python):
    job = _job(tmp_path, api_key=SECRET, api_key_env="MY_ENDPOINT_KEY")
    job_file = tmp_path / "job.yaml"
    child = _start(tmp_path, "exit:4", job, resume=True, flags=["--no-progress"])
    assert child.wait() == 4  # the child's exit code, as it gave it
    seen = _record(tmp_path)
    assert seen["argv"] == [
        "-m", "pipeline", "resume", str(tmp_path / "out"),
        "--address", "10.0.0.1:6379", "--s3-region", "eu-west-1", "--no-progress",
    ]  # fmt: skip
    assert seen["env"]["MY_ENDPOINT_KEY"] == SECRET
    assert not job_file.exists()  # the checkpoint holds the job


def test_a_child_that_ignores_sigint_is_killed_after_the_grace(tmp_path, fake_python):
    child = _start(tmp_path, "ignore-sigint", grace=1.0)
    _record(tmp_path)
    t0 = time.monotonic()
    assert child.stop() == -signal.SIGKILL
    assert 1.0 <= time.monotonic() - t0 < 10


def test_a_polled_child_is_killed_once_its_grace_has_passed(tmp_path, fake_python):
    """The server's way: wait a poll at a time, interrupting (again and again) between polls."""
    child = _start(tmp_path, "ignore-sigint", grace=1.0)
    _record(tmp_path)
    assert child.wait(0.1) is None  # still running
    t0 = time.monotonic()
    polls = 0
    while (rc := child.wait(0.3)) is None:
        child.interrupt()  # only the first one signals, and starts the grace
        polls += 1
    assert rc == -signal.SIGKILL and polls >= 2
    assert 1.0 <= time.monotonic() - t0 < 10


def test_a_child_that_aborts_on_sigint_ends_within_the_grace_with_its_log(tmp_path, fake_python):
    log_file = tmp_path / "job.log"
    log_file.write_text("an earlier attempt\n")
    child = _start(tmp_path, "abort-on-sigint", log_file=log_file)
    _record(tmp_path)
    t0 = time.monotonic()
    assert child.stop() == 130
    assert time.monotonic() - t0 < 10
    assert log_file.read_text().splitlines() == [
        "an earlier attempt",
        "fake job started",
        "interrupted; finished rows are kept",
    ]


def test_sigint_reaches_the_child_even_where_the_launcher_ignores_it(tmp_path, fake_python):
    """A shell's background job starts with SIGINT ignored, and exec keeps that: the child gets it back."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = _start(tmp_path, "abort-on-sigint")
    finally:
        signal.signal(signal.SIGINT, previous)
    seen = _record(tmp_path)
    assert seen["sigint"] != str(signal.SIG_IGN)
    assert child.stop() == 130
