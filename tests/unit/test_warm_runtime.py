"""`nightshift up`'s state, and when a run may use its warm runtime: pure checks, no Ray."""

from __future__ import annotations

import datetime as dt
import os
import stat
import subprocess
import sys

import pytest

from pipeline import __version__
from pipeline.config import JobConfig
from pipeline.runtime.hosting import warm_runtime as wr


def _state(**changes) -> wr.WarmRuntime:
    fields = {
        "address": "127.0.0.1:6379",
        "pid": os.getpid(),
        "idle_timeout_s": 60.0,
        "started_at": dt.datetime.now(dt.timezone.utc),
        "python": sys.executable,
        "version": __version__,
        "engine_env": wr.engine_environment({"VLLM_CPU_KVCACHE_SPACE": "4", "PATH": "/bin"}),
        **changes,
    }
    return wr.WarmRuntime(**fields)


def _job(tmp_path, **resources) -> JobConfig:
    return JobConfig.model_validate(
        {"input": str(tmp_path / "in.jsonl"), "output": str(tmp_path / "out"), "resources": resources}
    )


@pytest.mark.parametrize(
    ("text", "seconds"), [("900", 900), ("90s", 90), ("30m", 1800), ("2h", 7200), ("1.5m", 90)]
)
def test_durations_read_as_seconds(text, seconds):
    assert wr.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5m", "ten minutes", "5d", "m"])
def test_a_bad_duration_names_the_flag_and_the_forms_it_takes(text):
    with pytest.raises(wr.WarmRuntimeError, match=r"--idle-timeout .*900, 90s, 30m or 2h"):
        wr.parse_duration(text)


def test_the_engine_environment_keeps_only_what_an_engine_reads_and_never_the_values():
    env = wr.engine_environment(
        {
            "VLLM_CPU_KVCACHE_SPACE": "4",
            "OMP_NUM_THREADS": "2",
            "HF_TOKEN": "secret",
            "PATH": "/bin",
            "HOME": "/r",
        }
    )
    assert sorted(env) == ["HF_TOKEN", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE"]
    assert "secret" not in str(env.values()) and all(len(v) == 64 for v in env.values())


def test_a_run_from_the_same_environment_may_use_it():
    assert wr.mismatch(_state(), {"VLLM_CPU_KVCACHE_SPACE": "4", "PATH": "/usr/bin"}, sys.executable) is None


@pytest.mark.parametrize(
    ("environ", "python", "why"),
    [
        ({"VLLM_CPU_KVCACHE_SPACE": "8"}, sys.executable, "other values of VLLM_CPU_KVCACHE_SPACE"),
        ({}, sys.executable, "other values of VLLM_CPU_KVCACHE_SPACE"),
        (
            {"VLLM_CPU_KVCACHE_SPACE": "4", "CUDA_VISIBLE_DEVICES": "1"},
            sys.executable,
            "other values of CUDA_VISIBLE_DEVICES",
        ),
        ({"VLLM_CPU_KVCACHE_SPACE": "4"}, "/opt/other/python", "this run /opt/other/python"),
    ],
)
def test_a_run_whose_engines_would_differ_is_told_why_it_does_not_use_it(environ, python, why):
    assert why in wr.mismatch(_state(), environ, python)


def test_another_nightshift_version_does_not_use_it():
    assert "nightshift 0.0.0-other" in wr.mismatch(_state(version="0.0.0-other"), {}, sys.executable)


def test_attach_gives_the_runtime_and_detach_takes_it_back(tmp_path):
    job = _job(tmp_path)
    attached = wr.attach(job, _state())
    assert attached.resources.address == "127.0.0.1:6379"
    assert attached.engine.warm_engines == wr.KEEPER
    assert wr.detach(attached) == job


def test_detach_leaves_a_job_on_a_cluster_of_its_own_as_it_is(tmp_path):
    job = _job(tmp_path, address="10.0.0.1:6379")
    assert wr.detach(job) is job


def test_the_state_file_is_private_and_whole(tmp_path):
    path = tmp_path / "up" / "state.json"
    state = _state()
    wr.write_state(state, path)
    assert wr.read_state(path) == state
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]  # no scratch file left


def test_a_state_file_whose_daemon_is_gone_is_removed(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = tmp_path / "state.json"
    wr.write_state(_state(pid=gone.pid), path)
    assert wr.find_runtime(path) is None
    assert not path.exists()


def test_a_live_daemons_state_is_found(tmp_path):
    path = tmp_path / "state.json"
    state = _state()
    wr.write_state(state, path)
    assert wr.find_runtime(path) == state


def test_an_unreadable_state_file_is_no_runtime(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("{not json")
    assert wr.find_runtime(path) is None
