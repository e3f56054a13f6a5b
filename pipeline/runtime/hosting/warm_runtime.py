"""A warm runtime on this machine (`nightshift up` / `nightshift down`): a Ray instance and a warm-engine keeper
that outlive one `nightshift run`, so the next run of the same model does not pay Ray's start nor its engines'.

    nightshift up ─▶ a daemon process (`python -m pipeline.runtime.hosting.warm_runtime`, its own session)
                       ├─ a local Ray instance (token-authenticated, the head's token: cluster/auth.py)
                       ├─ the EngineKeeper named KEEPER (runtime/engines/warm_keeper.py), owned by the daemon
                       ├─ task hosts (runtime/hosting/task_hosts.py): the runs' ingest and finalize tasks, imports done
                       └─ $NIGHTSHIFT_HOME/up/state.json: where it is (mode 0600 in a 0700 directory)
    nightshift run ─▶ finds the state, joins that Ray, takes its engines from the keeper (engine.warm_engines)

- A run uses the runtime only when it would otherwise start a private Ray (no --address) and it can serve it as a
  private Ray would: the same Python and nightshift, and the same engine environment (vLLM's, the devices', the
  numeric libraries' variables: engines inherit the daemon's, not the run's). Otherwise it starts its own Ray and
  says why. `--no-warm` always starts its own.
- A job begun on the runtime keeps neither its address nor its keeper: `resume` uses the runtime if it is up then,
  and a private Ray if not.
- Idle: the keeper stops engines no job has used for the idle timeout, and the daemon then ends, taking Ray with it.
  `nightshift down` ends it at once (SIGTERM: the keeper's engines stop, Ray shuts down, the state file goes).
- Ownership: the daemon owns the keeper and the keeper owns the engines, so a daemon that dies takes them all
  with it; a state file left by a dead daemon is found stale and removed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pipeline import __version__
from pipeline.config import JobConfig
from pipeline.runtime.hosting.job_env import ENGINE_PREFIXES

KEEPER = "nightshift-up"  # the keeper's actor name (namespace: warm_keeper.NAMESPACE)
DEFAULT_IDLE_TIMEOUT_S = 30 * 60.0
START_TIMEOUT_S = 180.0  # a cold Ray start on a loaded 2-core box takes 10-30 s
STOP_TIMEOUT_S = 60.0
POLL_S = 2.0
MAX_TASK_HOSTS = 8  # a job on the runtime runs at most this many ingest and finalize tasks at once

# What an engine reads from its environment (job_env.ENGINE_PREFIXES, and these): a warm engine was started with
# the daemon's, so a run whose values differ would be served by engines other than the ones it asked for. Compared
# by hash; values never stored.
ENGINE_ENV_NAMES = frozenset(
    {"LD_PRELOAD", "LD_LIBRARY_PATH", "NIGHTSHIFT_CPU_LOCK_DIR", "HUGGING_FACE_HUB_TOKEN"}
)


class WarmRuntimeError(RuntimeError):
    """`nightshift up` / `down` could not do what was asked; the message says what to change."""


class WarmRuntime(BaseModel):
    """What `nightshift up` leaves in its state file: where the runtime is and what its engines were started with."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    address: str = Field(description="The Ray instance's GCS address (host:port).")
    pid: int = Field(description="The daemon's process id: it owns the Ray instance and the keeper.")
    keeper: str = Field(default=KEEPER, description="The warm-engine keeper's actor name.")
    idle_timeout_s: float = Field(description="Engines unused this long stop; then the daemon ends.")
    started_at: dt.datetime
    python: str = Field(description="The daemon's Python: a run with another one cannot join its Ray.")
    version: str = Field(description="The daemon's nightshift version.")
    engine_env: dict[str, str] = Field(
        description="sha256 of each engine-environment variable the daemon had (engine_environment)."
    )


# --- where it is --------------------------------------------------------------------------------------------------


def runtime_dir() -> Path:
    from cluster.home import nightshift_home

    return nightshift_home() / "up"


def state_path() -> Path:
    return runtime_dir() / "state.json"


def log_path() -> Path:
    return runtime_dir() / "daemon.log"


def read_state(path: Path | None = None) -> WarmRuntime | None:
    path = path or state_path()
    try:
        return WarmRuntime.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


def write_state(state: WarmRuntime, path: Path | None = None) -> None:
    """Written whole, then renamed into place (a reader never sees half a file); mode 0600 in a 0700 directory."""
    from pipeline.local_files import atomic_write_bytes  # its scratch file is mkstemp's: 0600 from the start

    path = path or state_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    atomic_write_bytes(path, state.model_dump_json(indent=2).encode())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the number: not our daemon
        return False
    return True


def find_runtime(path: Path | None = None) -> WarmRuntime | None:
    """The running warm runtime, if there is one; a state file whose daemon is gone is removed."""
    path = path or state_path()
    state = read_state(path)
    if state is None:
        return None
    if not pid_alive(state.pid):
        path.unlink(missing_ok=True)
        return None
    return state


# --- whether a run can use it ---------------------------------------------------------------------------------------


def engine_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The engine-environment variables of `environ`, each as the sha256 of its value."""
    return {
        name: hashlib.sha256(value.encode()).hexdigest()
        for name, value in sorted(environ.items())
        if name in ENGINE_ENV_NAMES or name.startswith(ENGINE_PREFIXES)
    }


def mismatch(state: WarmRuntime, environ: Mapping[str, str], python: str) -> str | None:
    """Why this process cannot run its job on the runtime as a private Ray would run it; None when it can."""
    if state.python != python:
        return f"it runs {state.python}, this run {python}"
    if state.version != __version__:
        return f"it runs nightshift {state.version}, this run {__version__}"
    ours = engine_environment(environ)
    differ = sorted(
        name for name in set(ours) | set(state.engine_env) if ours.get(name) != state.engine_env.get(name)
    )
    if differ:
        return f"its engines were started with other values of {', '.join(differ)}"
    return None


def detach(job: JobConfig) -> JobConfig:
    """A job config without what the runtime gave it: a resumed job chooses again."""
    if job.engine.warm_engines != KEEPER:
        return job
    return job.model_copy(
        update={
            "engine": job.engine.model_copy(update={"warm_engines": None}),
            "resources": job.resources.model_copy(update={"address": None}),
        }
    )


def attach(job: JobConfig, state: WarmRuntime) -> JobConfig:
    """A job config that runs on the runtime: its Ray, its keeper's engines."""
    return job.model_copy(
        update={
            "engine": job.engine.model_copy(update={"warm_engines": state.keeper}),
            "resources": job.resources.model_copy(update={"address": state.address}),
        }
    )


# --- up and down ------------------------------------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """Seconds from `90`, `90s`, `30m`, `2h`."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not found or float(found.group(1)) <= 0:
        raise WarmRuntimeError(
            f"--idle-timeout {text!r}: give a positive duration such as 900, 90s, 30m or 2h"
        )
    return float(found.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[found.group(2)]


def start(idle_timeout_s: float, timeout_s: float = START_TIMEOUT_S) -> tuple[WarmRuntime, bool]:
    """The runtime, started unless one runs already (then it is returned as it is); and whether it was started."""
    running = find_runtime()
    if running is not None:
        return running, False
    runtime_dir().mkdir(mode=0o700, parents=True, exist_ok=True)
    log = log_path()
    with open(log, "ab") as out:
        os.chmod(log, 0o600)
        daemon = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pipeline.runtime.hosting.warm_runtime",
                "--idle-timeout",
                str(idle_timeout_s),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in this terminal, or its closing, must not reach it
            close_fds=True,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_state()
        if state is not None and state.pid == daemon.pid:
            return state, True
        if daemon.poll() is not None:
            raise WarmRuntimeError(f"the warm runtime did not start (exit {daemon.returncode}): {_tail(log)}")
        time.sleep(0.2)
    daemon.terminate()
    raise WarmRuntimeError(f"the warm runtime did not start within {timeout_s:.0f} s: {_tail(log)}")


def stop(timeout_s: float = STOP_TIMEOUT_S) -> WarmRuntime | None:
    """End the runtime (its engines, its Ray); the one that ran, or None when none did."""
    state = find_runtime()
    if state is None:
        return None
    os.kill(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(state.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid_alive(state.pid):
        # Ray's own processes notice their driver's death and exit; the daemon's session goes with it.
        os.killpg(state.pid, signal.SIGKILL)
    state_path().unlink(missing_ok=True)
    return state


def describe(state: WarmRuntime) -> dict:
    """The keeper's engines, asked over Ray (joins the runtime's Ray as a driver)."""
    import logging

    from cluster.auth import driver_environment

    with driver_environment(state.address):
        import ray  # in the driver's environment: Ray reads its auth mode once, at import

        from pipeline.runtime.engines.warm_keeper import find_keeper

        ray.init(
            address=state.address, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR
        )
        try:
            keeper = find_keeper(state.keeper)
            return ray.get(keeper.describe.remote(), timeout=30) if keeper is not None else {}
        finally:
            ray.shutdown()


def task_host_count(cpus: float) -> int:
    """Task hosts for a machine of `cpus` CPUs: one per CPU, as Ray would start task workers, up to MAX_TASK_HOSTS
    (each holds the tokenizer's libraries in memory while the runtime is up)."""
    return max(1, min(MAX_TASK_HOSTS, int(cpus)))


def claim_path() -> Path:
    return runtime_dir() / "last_run"


def claim() -> None:
    """A run has chosen the runtime: its idle time starts again now, so it does not end while the run joins."""
    path = claim_path()
    path.touch(mode=0o600)
    os.utime(path)


def idle_seconds(keeper_idle_s: float | None, own_job: str) -> float | None:
    """How long nothing has used the runtime; None while something does. Used: a job holds a keeper's engine
    (keeper_idle_s None), a driver other than the daemon is connected (a run between joining and taking its
    engines, or one with no engines to take), or a run chose the runtime moments ago (`claim`)."""
    import ray

    if keeper_idle_s is None:
        return None
    try:
        drivers = [j for j in ray._private.state.jobs() if not j["IsDead"] and j["JobID"] != own_job]
    except Exception:  # noqa: BLE001 - the job table is Ray's debugging API: without it, the keeper's word stands
        drivers = []
    if drivers:
        return None
    try:
        since_claim = time.time() - claim_path().stat().st_mtime
    except OSError:
        since_claim = keeper_idle_s
    return min(keeper_idle_s, since_claim)


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"(no log at {path})"
    return " | ".join(text[-lines:]) + f" (log: {path})"


# --- the daemon -----------------------------------------------------------------------------------------------------


def serve(idle_timeout_s: float) -> None:
    """The daemon: Ray and the keeper, until SIGTERM or the idle timeout."""
    from cluster.auth import share_local_ray

    share_local_ray()  # before Ray is imported (it reads its auth mode once): the runs find the head's token

    import ray

    from pipeline.runtime.engines.warm_keeper import NAMESPACE, start_keeper
    from pipeline.runtime.hosting.session import start_ray
    from pipeline.runtime.hosting.task_hosts import start_task_hosts, stop_task_hosts

    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stopping.append(True))
    start_ray(None)
    keeper = start_keeper(KEEPER, idle_timeout_s)
    ray.get(keeper.describe.remote())
    # Held for the daemon's life: an actor whose handles all go out of scope is ended by Ray, named or not.
    hosts = start_task_hosts(KEEPER, task_host_count(ray.cluster_resources().get("CPU", 1)), NAMESPACE)
    state = WarmRuntime(
        address=ray.get_runtime_context().gcs_address,
        pid=os.getpid(),
        idle_timeout_s=idle_timeout_s,
        started_at=dt.datetime.now(dt.timezone.utc),
        python=sys.executable,
        version=__version__,
        engine_env=engine_environment(os.environ),
    )
    write_state(state)
    print(json.dumps({"event": "up", "address": state.address, "pid": state.pid}), flush=True)
    reason = "stopped"
    own_job = ray.get_runtime_context().get_job_id()
    try:
        while not stopping:
            time.sleep(POLL_S)
            idle = idle_seconds(ray.get(keeper.describe.remote(), timeout=60).get("idle_s"), own_job)
            if idle is not None and idle >= idle_timeout_s:
                reason = f"idle for {idle:.0f} s"
                break
    finally:
        if read_state() == state:
            state_path().unlink(missing_ok=True)
        stop_task_hosts(hosts)
        ray.shutdown()
        print(json.dumps({"event": "down", "reason": reason}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.runtime.hosting.warm_runtime")
    parser.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S)
    serve(parser.parse_args().idle_timeout)


if __name__ == "__main__":
    main()
