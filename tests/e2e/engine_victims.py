"""Finding what to kill in a running job's engines, for the tests that kill them: an engine with rows in flight
(from the job monitor's work ledger) and the processes vLLM runs under its actor."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import psutil


def engine_with_work_in_flight(job_id: str, job: threading.Thread, timeout_s: float = 300) -> tuple[str, int]:
    """The first engine of the job with rows in flight (begun, not yet returned), and its actor's pid. Rows are
    begun only once the engine has started."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline and job.is_alive(), "the engine never got work"
        try:
            monitor = ray.get_actor(f"nightshift-monitor-{job_id}")
            work, engines = ray.get([monitor.work.remote(), monitor.snapshot.remote()])
        except ValueError:  # the monitor is not up yet
            work, engines = {}, {}
        for engine, info in work.items():
            if info["in_flight"] > 0 and engine in engines:
                return engine, engines[engine]["pid"]
        time.sleep(0.1)


@contextlib.contextmanager
def held(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) for the block, then continued: none of its threads runs meanwhile, so it does
    not exit, acknowledge, lease or begin anything either; its children (vLLM's engine core and its ranks) run on. A
    process already gone fails the test."""
    try:
        os.kill(pid, signal.SIGSTOP)
        exited = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # a signal to a zombie "succeeds"
    except (ProcessLookupError, psutil.NoSuchProcess):
        exited = True
    if exited:
        raise AssertionError(f"the engine actor {pid} exited before it could be held (its job ended?)")
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def until_dead(process: psutil.Process, timeout_s: float = 30) -> None:
    """Returns once `process` is dead: gone, or a zombie its parent has not reaped yet (a parent held by `held`
    reaps nothing until it is continued)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        assert time.monotonic() < deadline, f"{process.pid} still runs {timeout_s} s after its kill"
        time.sleep(0.05)


def vllm_process(actor_pid: int, title: str, timeout_s: float = 60) -> psutil.Process:
    """The process under an engine actor whose title (vLLM's setproctitle: `VLLM::EngineCore`, `VLLM::Worker_TP1`,
    ...) contains `title`. Waited for: a process takes its title a moment after it starts, later still on a busy box,
    and an engine's ranks may still be coming up when its first rows are leased.

    A child that the titled process forks (a compile or tokenizer worker) carries the parent's title until it execs,
    so matches below another match are its children, not candidates: the topmost match is the one."""
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while True:
        try:
            processes = psutil.Process(actor_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            raise AssertionError(
                f"the engine actor {actor_pid} exited before one {title} process was found under it; seen: {seen}"
            ) from None
        matches = {}
        for child in processes:
            try:
                if title in child.name() or title in " ".join(child.cmdline()):
                    matches[child.pid] = child
            except psutil.NoSuchProcess:
                continue
        topmost = []
        for child in matches.values():
            try:
                if child.ppid() not in matches:
                    topmost.append(child)
            except psutil.NoSuchProcess:
                continue
        seen = [_describe(p) for p in processes]
        if len(topmost) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(topmost) == 1, (
        f"expected one topmost {title} process under the actor {actor_pid}, found {topmost}; its processes: {seen}"
    )
    return topmost[0]


def _describe(process: psutil.Process) -> str:
    try:
        return f"{process.pid}<{process.ppid()} {process.name()!r} {' '.join(process.cmdline())[:80]!r}"
    except psutil.NoSuchProcess:
        return f"{process.pid} (gone)"
