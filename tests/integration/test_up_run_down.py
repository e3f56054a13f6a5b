"""`nightshift up` / `run` / `down` as a user types them (each a fresh process, fake engine): the second run takes
the first run's engines warm, a run from another engine environment or with --no-warm starts its own Ray, `down`
ends Ray and every engine, and an idle runtime ends by itself. (The real engine's warm run:
tests/e2e/test_warm_runtime_real_engine.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.runtime.hosting import warm_runtime
from tests.lines import MODEL_NAME, chat_line, read_jsonl, write_lines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROWS = 24


@pytest.fixture
def home(tmp_path, embedded_model) -> dict[str, str]:
    """A machine of its own: NIGHTSHIFT_HOME (where `up` leaves its state) is a fresh directory, so no other test's
    run finds this runtime; the embedded model is given by path."""
    (tmp_path / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH_", "RAY_ADDRESS"))}
    env.update(NIGHTSHIFT_HOME=str(tmp_path / "home"), NIGHTSHIFT_WARM="1")
    return env


def nightshift(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def run(tmp_path: Path, name: str, env: dict[str, str], model: Path, *flags: str) -> tuple[dict, str]:
    """A fake-engine job of ROWS lines; its manifest and its log."""
    source = write_lines(
        tmp_path / f"{name}.jsonl", [chat_line(f"{name}-{i:03d}", f"question {i}") for i in range(ROWS)]
    )
    out = tmp_path / f"{name}-out"
    done = nightshift(
        "run", str(source), str(out), "--engine", "fake", "--model", str(model), "--served-model-name", MODEL_NAME,
        "--num-engines", "1", "--cpus-per-engine", "1", "--no-progress", *flags, env=env,
    )  # fmt: skip
    assert f"{ROWS} total, {ROWS} ok" in done.stdout
    assert sorted(r["custom_id"] for r in read_jsonl(out.glob("results-*.jsonl"))) == [
        f"{name}-{i:03d}" for i in range(ROWS)
    ]
    return json.loads((out / "manifest.json").read_text()), done.stderr


def state_of(env: dict[str, str]) -> warm_runtime.WarmRuntime | None:
    return warm_runtime.read_state(Path(env["NIGHTSHIFT_HOME"]) / "up" / "state.json")


def gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while warm_runtime.pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return not warm_runtime.pid_alive(pid)


def ray_processes_of(session_pid: int) -> list[str]:
    """Processes of the daemon's session (Ray's GCS, raylet and workers start inside it) still running."""
    listing = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True).stdout
    return [line for line in listing.splitlines() if line.split()[1] == str(session_pid)]


def test_up_run_run_down(tmp_path, home, embedded_model):
    up = nightshift("up", "--idle-timeout", "10m", env=home)
    state = state_of(home)
    assert state is not None and f"Ray at {state.address}" in up.stdout
    try:
        again = nightshift("up", env=home)
        assert "already up" in again.stdout and state_of(home) == state  # one runtime, not two

        first, log = run(tmp_path, "first", home, embedded_model.path)
        assert "on the warm runtime" in log
        assert first["engine"]["reused"] == 0  # the runtime's first engine: started by this run
        assert "tasks run on the warm runtime's task hosts" in log
        assert "ran=\"on the warm runtime's" in log  # finalize's tasks too

        second, log = run(tmp_path, "second", home, embedded_model.path)
        assert "on the warm runtime" in log
        assert second["engine"]["reused"] == 1  # the first run's engine, warm
        # Its tasks ran in the same hosts' processes (the real engine's tokenizer stays loaded there:
        # tests/e2e/test_warm_runtime_real_engine.py).
        assert "tasks run on the warm runtime's task hosts" in log

        # The runtime keeps the engine for the next run: nothing of either job holds it.
        status = nightshift("up", env=home).stdout
        assert "warm engines: 1 kept, 1 started and 1 handed to a later run" in status, status
        assert f"{MODEL_NAME} (fake): idle" in status
    finally:
        down = nightshift("down", env=home)
    assert f"daemon pid {state.pid} ended" in down.stdout
    assert gone(state.pid, 30) and state_of(home) is None
    assert ray_processes_of(state.pid) == [], "Ray outlived `nightshift down`"
    assert "nightshift is not up" in nightshift("down", env=home).stdout


def test_runs_that_cannot_share_its_engines_start_their_own_ray(tmp_path, home, embedded_model):
    nightshift("up", "--idle-timeout", "10m", env=home)
    try:
        other = {**home, "VLLM_CPU_KVCACHE_SPACE": "3"}  # engines started under other settings would differ
        manifest, log = run(tmp_path, "other-env", other, embedded_model.path)
        assert "not using the warm runtime" in log and "VLLM_CPU_KVCACHE_SPACE" in log
        assert manifest["engine"]["reused"] == 0

        manifest, log = run(tmp_path, "no-warm", home, embedded_model.path, "--no-warm")
        assert "warm runtime" not in log and manifest["engine"]["reused"] == 0

        assert "warm engines: 0 kept, 0 started" in nightshift("up", env=home).stdout  # neither run used it
    finally:
        nightshift("down", env=home)


def test_an_idle_runtime_ends_by_itself(tmp_path, home, embedded_model):
    nightshift("up", "--idle-timeout", "20s", env=home)
    state = state_of(home)
    run(tmp_path, "only", home, embedded_model.path)
    assert warm_runtime.pid_alive(state.pid)  # the run's own time does not count as idle
    assert gone(state.pid, 120), "the runtime outlived its idle timeout"
    assert state_of(home) is None and ray_processes_of(state.pid) == []
    log = (Path(home["NIGHTSHIFT_HOME"]) / "up" / "daemon.log").read_text()
    assert '"reason": "idle for' in log
