"""The job-process launcher (pipeline/runtime/hosting/launcher.py) with a fake child (tests/fake_job_process.py) that
records what it was given (its arguments, its environment, the job file) and then behaves as told — exits, aborts
on SIGINT as a job does, or ignores SIGINT as a stuck job would."""

from __future__ import annotations

import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.config import JobConfig
from pipeline.runtime.hosting.launcher import STOP_GRACE_SECONDS, start_job
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


def test_a_sigint_sent_as_the_child_starts_is_not_lost(tmp_path, fake_python):
    """Where the launcher ignores SIGINT the child starts with it ignored too, until its first line sets it up: a
    stop sent before then waits (blocked, not dropped) and ends the child then, not the grace's SIGKILL."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = _start(tmp_path, "abort-on-sigint", grace=20.0)
        t0 = time.monotonic()
        code = child.stop()  # at once: the child is still starting
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code in (130, -signal.SIGINT), code
    assert time.monotonic() - t0 < 20


def test_sigint_reaches_the_child_even_from_a_thread_that_blocks_it(tmp_path, fake_python):
    """Ray's threads block SIGINT, and a child starts with its starting thread's signal mask."""
    import threading

    seen = {}

    def watcher() -> None:  # as the server's: starts the job, and lives as long as it is wanted
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        child = _start(tmp_path, "abort-on-sigint")
        seen["mask"] = signal.pthread_sigmask(signal.SIG_BLOCK, set())
        _record(tmp_path)
        seen["code"] = child.stop()

    thread = threading.Thread(target=watcher)
    thread.start()
    thread.join()
    assert signal.SIGINT in seen["mask"]  # the thread's own mask is as it was
    assert seen["code"] == 130


# Set by the test below while it starts a child; read by a fork handler that stays registered for the process.
_FORK_MARK: list[Path] = []


def _mark_fork_in_child() -> None:
    for path in _FORK_MARK:
        path.write_text("a fork handler ran in the child")


def test_a_child_starts_without_fork_handlers(tmp_path, fake_python):
    """A launcher runs Ray, whose gRPC core restarts its threads in a forked child: the child must start without
    fork() (a preexec_fn forces it, and runs every fork handler in the child before exec)."""
    os.register_at_fork(after_in_child=_mark_fork_in_child)
    mark = tmp_path / "forked"
    _FORK_MARK.append(mark)
    try:
        child = _start(tmp_path, "exit:0")
    finally:
        _FORK_MARK.clear()
    assert child.wait() == 0
    assert not mark.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_the_thread_that_started_it(tmp_path, fake_python):
    """The batch's watcher thread lives exactly as long as its job is wanted (and a killed launcher takes all its
    threads): the job gets SIGTERM once that thread is gone."""
    import threading

    for wait_for_the_child in (True, False):  # the thread ends after the child's start, or during it
        record = tmp_path / "record.jsonl"
        record.unlink(missing_ok=True)
        started: dict = {}

        def watcher(started=started, wait_for_the_child=wait_for_the_child) -> None:
            started["child"] = _start(tmp_path, "ignore-sigint")
            if wait_for_the_child:
                _record(tmp_path)  # the child is past follow_launcher

        thread = threading.Thread(target=watcher)
        thread.start()
        thread.join()
        assert started["child"].wait(20) == -signal.SIGTERM, wait_for_the_child


def test_a_job_started_by_hand_keeps_its_signals(tmp_path, monkeypatch):
    """`follow_launcher` does nothing in a process the launcher did not start: a user's own `python -m pipeline`
    keeps whatever SIGINT disposition its shell gave it."""
    from pipeline.runtime.hosting import launcher

    monkeypatch.delenv(launcher.LAUNCHER_ENV, raising=False)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        launcher.follow_launcher()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


# What the launcher's own environment holds besides what a job needs: a server's API keys and credentials.
LAUNCHER_ENVIRONMENT = {
    "NIGHTSHIFT_API_KEYS": "server-key-" + "0" * 20,
    "SERVER_KEYS_ELSEWHERE": "server-key-" + "1" * 20,
    "SOME_CANARY": "canary-value",
    "AWS_ACCESS_KEY_ID": "AKIA-canary",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-canary",
    "GOOGLE_APPLICATION_CREDENTIALS": "/secrets/gcp.json",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN_PATH": "/home/ns/.nightshift/ray/auth_token",
    "HF_TOKEN": "hf-token-for-gated-models",
    "LC_ALL": "C.UTF-8",
    "NIGHTSHIFT_HOME": "/home/ns/.nightshift",
    "VLLM_CPU_OMP_THREADS_BIND": "0-3",
}


@pytest.fixture
def launcher_environment(monkeypatch):
    for name, value in LAUNCHER_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)


def test_a_job_gets_only_the_variables_a_job_needs(tmp_path, fake_python, launcher_environment):
    child = _start(tmp_path, "exit:0", withhold=["SERVER_KEYS_ELSEWHERE"])
    assert child.wait() == 0
    env = _record(tmp_path)["env"]
    for gone in (
        "NIGHTSHIFT_API_KEYS",
        "SERVER_KEYS_ELSEWHERE",
        "SOME_CANARY",
        "GOOGLE_APPLICATION_CREDENTIALS",
    ):
        assert gone not in env, gone
    assert not any(name.startswith("AWS_") for name in env)  # the job's locations are local
    for kept in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "HF_TOKEN", "LC_ALL", "NIGHTSHIFT_HOME", "PATH"):
        assert env[kept] == os.environ[kept], kept
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert env["FAKE_BEHAVIOUR"] == "exit:0"  # the caller's own variables are added


def test_s3_credentials_reach_only_a_job_with_an_s3_location(tmp_path, fake_python, launcher_environment):
    job = _job(tmp_path).model_copy(update={"output": "s3://bucket/batches/out"})
    child = _start(tmp_path, "exit:0", job)
    assert child.wait() == 0
    env = _record(tmp_path)["env"]
    assert env["AWS_ACCESS_KEY_ID"] == "AKIA-canary" and env["AWS_SECRET_ACCESS_KEY"] == "aws-secret-canary"
    assert "NIGHTSHIFT_API_KEYS" not in env and "SOME_CANARY" not in env


def test_an_adapter_on_s3_is_an_s3_location_too(tmp_path):
    from pipeline.runtime.hosting.job_env import uses_s3

    assert not uses_s3(_job(tmp_path))
    adapter = {"sql": "s3://bucket/adapters/sql"}
    assert uses_s3(JobConfig.model_validate({"engine": {"vllm": {"lora_modules": adapter}}}))
    pool = {"name": "lora", "engine_overrides": {"lora_modules": adapter}}
    assert uses_s3(JobConfig.model_validate({"pools": [pool]}))


def test_a_withheld_variable_never_passes_even_one_the_table_allows(
    tmp_path, fake_python, launcher_environment
):
    child = _start(tmp_path, "exit:0", withhold=["RAY_AUTH_TOKEN_PATH", "MY_ENDPOINT_KEY"])
    assert child.wait() == 0
    assert "RAY_AUTH_TOKEN_PATH" not in _record(tmp_path)["env"]


def test_the_variable_the_http_engine_reads_its_key_from_passes(tmp_path, fake_python, monkeypatch):
    """`run --hours --engine http` with the key in $NIGHTSHIFT_API_KEY (or the variable the job names): each
    shift's job reads it there."""
    monkeypatch.setenv("MY_ENDPOINT_KEY", SECRET)
    child = _start(tmp_path, "exit:0", _job(tmp_path, api_key_env="MY_ENDPOINT_KEY"))
    assert child.wait() == 0
    assert _record(tmp_path)["env"]["MY_ENDPOINT_KEY"] == SECRET
