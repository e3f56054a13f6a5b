"""The job-process launcher. Runs on the driver (`nightshift run --hours`, one child per shift: runtime/hosting/shifts.py)
or on the Batch API's server replica (one child per batch: server/runner.py), and starts one job as a child
`python -m pipeline run|resume` process.

Why a child process and not the job in the launcher's own process: a job must be stoppable, and its engines gone
once it is. The child gets SIGINT, the signal Ctrl-C sends, so the job's own abort path releases its engines while
every staged row stays in `_staging/`; a child that outlives its grace is killed (SIGKILL), and Ray ends a dead
driver's actors. A job interrupted in-process instead leaves Ray Data's executor winding its engines down in the
background, still staging rows while whatever resumes it lists what is pending.

What the launcher owns, so both callers do it the same way:
- the command line: `resume OUTPUT` when the job's checkpoint exists (the checkpoint holds the job), else
  `run --config JOB_FILE`, with the job (its JobConfig as YAML) written to JOB_FILE first, readable by its owner only;
- secrets: the http engine's api_key and the storage's http_headers reach the child only through its environment
  (under `api_key_env`, `http_headers_env`), never on its command line nor in the job file (JobConfig never
  serializes them);
- the child's environment: only what a job needs of the launcher's (runtime/hosting/job_env.py), never all of it — the
  server's API keys and credentials stay with the server;
- the child's process: it stays in the launcher's process group (a Ctrl-C on the terminal reaches both), gets a
  default SIGINT disposition whatever it inherited, and on Linux dies with the thread that started it. The child
  is started without fork(): the launcher runs Ray, whose gRPC core restarts its poller threads in a forked child,
  and closing the child's descriptors before exec can then abort it ("epoll_wait error: Bad file descriptor",
  exit -6, a batch failed before its job began). So no code runs between fork and exec; the job process sets up
  its signals itself, first thing (`follow_launcher`, from `python -m pipeline`);
- stopping it: SIGINT, then STOP_GRACE_SECONDS to end, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import yaml

if TYPE_CHECKING:
    from pipeline.config import JobConfig

log = structlog.get_logger(__name__)

# A job told to stop (SIGINT) gets this long to abort cleanly (release its engines) before SIGKILL. The one grace
# of every launched job; the server replica's Serve shutdown timeout (server/app.py) is longer than it, so a
# replica stop never cuts a job's grace short.
STOP_GRACE_SECONDS = 60.0

# "PID:TID" of the launcher's process and of the thread that started the child, in the child's environment: tells
# `python -m pipeline` that it is a launched job (`follow_launcher`), and whose end it must not outlive.
LAUNCHER_ENV = "NIGHTSHIFT_LAUNCHER"

# Where the child finds the http engine's token when the job does not name a variable (JobConfig's default name).
DEFAULT_API_KEY_ENV = "NIGHTSHIFT_API_KEY"


def job_command(job: JobConfig, resume: bool, job_file: Path, flags: Sequence[str] = ()) -> list[str]:
    """The child's command line. `resume`: the job's checkpoint exists, and holds the job; the command names only
    where it is (OUTPUT, the cluster, the object store). Else the job is written to `job_file` and run from it.
    `flags` are passed as given (--no-progress, --token-file …): never a secret."""
    if resume:
        where = [
            *(["--address", job.resources.address] if job.resources.address else []),
            *(["--s3-endpoint-url", job.storage.s3_endpoint_url] if job.storage.s3_endpoint_url else []),
            *(["--s3-region", job.storage.s3_region] if job.storage.s3_region else []),
        ]
        return [sys.executable, "-m", "pipeline", "resume", str(job.output), *where, *flags]
    write_job_file(job, job_file)
    return [sys.executable, "-m", "pipeline", "run", "--config", str(job_file), *flags]


def write_job_file(job: JobConfig, path: Path) -> None:
    """The job as YAML, owner-only (0600, like the rest of the server's data); the api_key is not in it (JobConfig
    never serializes it), the variable the child reads it from is."""
    spec = job.model_dump(mode="json", exclude_none=True)
    if job.engine.http.api_key is not None:
        spec["engine"]["http"]["api_key_env"] = _api_key_env(job)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an earlier attempt's file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as file:
        file.write(yaml.safe_dump(spec, sort_keys=False))


def job_environment(
    job: JobConfig, extra: Mapping[str, str] | None = None, withhold: Collection[str] = ()
) -> dict[str, str]:
    """The child's environment: the part of the launcher's a job may see (runtime/hosting/job_env.py: the allowlist; a
    name in `withhold` never), the variable the http engine reads its key from, `extra` over them, and a key given
    in the job's config under that variable — for a resumed job too, whose checkpoint names it."""
    from pipeline.runtime.hosting.job_env import inherited_environment

    env = inherited_environment(os.environ, job, withhold)
    key_env = getattr(job.engine.args(), "api_key_env", None)
    if key_env and key_env in os.environ and key_env not in withhold:
        env[key_env] = os.environ[key_env]
    env.update(extra or {})
    if job.engine.http.api_key is not None:
        env[_api_key_env(job)] = job.engine.http.api_key.get_secret_value()
    headers_env = job.storage.http_headers_env
    if headers_env and job.storage.http_headers and headers_env not in withhold:
        # Never in the job file (StorageConfig does not serialize them): the child reads them from here.
        env[headers_env] = json.dumps(job.storage.header_values())
    elif headers_env and headers_env in os.environ and headers_env not in withhold:
        env[headers_env] = os.environ[headers_env]
    return env


def _api_key_env(job: JobConfig) -> str:
    return job.engine.http.api_key_env or DEFAULT_API_KEY_ENV


class JobProcess:
    """One running child job. `interrupt` asks it to stop (SIGINT, once; the grace counts from then); `wait`
    returns its exit code and kills it once the grace has passed; `stop` does both. Thread-safe: one thread may
    wait while another interrupts."""

    def __init__(self, popen: subprocess.Popen, grace: float = STOP_GRACE_SECONDS) -> None:
        self._popen = popen
        self.grace = grace
        self._lock = threading.Lock()
        self._kill_at: float | None = None  # monotonic; set by the first interrupt
        self._killed = False

    @property
    def pid(self) -> int:
        return self._popen.pid

    def poll(self) -> int | None:
        return self._popen.poll()

    def interrupt(self) -> None:
        """SIGINT, as Ctrl-C: the job's abort path runs. Only the first call signals: a second SIGINT could cut
        that abort path short."""
        with self._lock:
            if self._kill_at is not None:
                return
            self._kill_at = time.monotonic() + self.grace
        if self._popen.poll() is None:
            self._popen.send_signal(signal.SIGINT)

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code; None if it still runs after `timeout` (None: wait for the end). A job interrupted more
        than the grace ago is killed meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            limits = [t - time.monotonic() for t in (deadline, self._kill_due()) if t is not None]
            try:
                return self._popen.wait(max(min(limits), 0.0) if limits else None)
            except subprocess.TimeoutExpired:
                pass
            if (due := self._kill_due()) is not None and time.monotonic() >= due:
                self._kill()
            elif deadline is not None and time.monotonic() >= deadline:
                return None

    def stop(self) -> int:
        """Interrupt it and wait for its end: within the grace, else killed. Its exit code."""
        self.interrupt()
        rc = self.wait()
        assert rc is not None
        return rc

    def _kill_due(self) -> float | None:
        return None if self._killed else self._kill_at

    def _kill(self) -> None:
        with self._lock:
            if self._killed:
                return
            self._killed = True
        if self._popen.poll() is None:
            log.warning("the job did not stop in time: killed", pid=self._popen.pid, grace_s=self.grace)
            self._popen.kill()


def start_job(
    job: JobConfig,
    *,
    resume: bool,
    job_file: Path,
    flags: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    withhold: Collection[str] = (),
    log_file: Path | None = None,
    grace: float = STOP_GRACE_SECONDS,
) -> JobProcess:
    """Start the job as a child process (see `job_command` and `job_environment`). `env`: variables to add to the
    child's environment; `withhold`: variables of the launcher's it must never get (e.g. the server's API keys).
    `log_file`: the child's stdout and stderr, appended; default: the launcher's own."""
    command = job_command(job, resume, job_file, flags)
    starter = f"{os.getpid()}:{threading.get_native_id()}"
    child_env = {**job_environment(job, env, withhold), LAUNCHER_ENV: starter}
    with (
        open(log_file, "ab") if log_file is not None else contextlib.nullcontext() as out,
        _sigint_blocked(),
    ):
        # No preexec_fn: with one, Python must fork() (and run every library's fork handlers in the child); without
        # one it starts the child with vfork/posix_spawn, which runs none.
        popen = subprocess.Popen(command, env=child_env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    return JobProcess(popen, grace)


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in the calling thread for the block, so the child starts with it blocked (a child takes its
    starting thread's mask): a SIGINT sent before the job's `follow_launcher` waits for it, even where the job
    inherited SIGINT ignored (a blocked signal is kept pending, never dropped as ignored)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def follow_launcher() -> None:
    """In a job process that `start_job` started (`python -m pipeline` calls this before anything else); nothing
    in any other process. What a launched job needs of its signals, set here because nothing runs in the child
    between fork and exec:
    - SIGINT turns into KeyboardInterrupt whatever the job inherited (a shell's background job starts with it
      ignored, and exec keeps that), so the job aborts cleanly when its launcher stops it; the job starts with it
      blocked (`start_job`), and one sent before this line is delivered here, once the handler is set;
    - on Linux, PR_SET_PDEATHSIG: the kernel sends SIGTERM to the job when the thread that started it exits — the
      shift's main thread, or the batch's watcher thread, which lives exactly as long as the job is wanted. A
      killed launcher leaves no orphan driving its job. A thread that ended before this line (the job was
      reparented then, and no signal comes) is looked for once the signal is set, and the job ends as the signal
      would have ended it."""
    starter = os.environ.pop(LAUNCHER_ENV, None)
    if starter is None:
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        pid, _, tid = starter.partition(":")
        if str(os.getppid()) != pid or not os.path.exists(f"/proc/{pid}/task/{tid}"):
            os.kill(os.getpid(), signal.SIGTERM)
