"""Warm task hosts: actors a long-lived runtime keeps, so that a job's cluster tasks run in processes that have
already imported what ingest and finalize import and loaded the model's tokenizer.

A Ray task runs in a worker process of its driver's Ray job, and a new driver never gets an earlier driver's
workers: every `nightshift run` pays a fresh worker's Python imports and a tokenizer load (3-4 s on a 2-core box)
before ingest can hand its first request to an engine, even on the warm engines of `nightshift up`. The `up` daemon
therefore also keeps TaskHost actors (named `<keeper>-tasks-<i>` in the keeper's namespace, owned by the daemon, no
CPU reserved: a task host works only while a job's executor waits on it). A run attached to that runtime finds them
(`find_task_hosts`) and its TaskExecutor sends each task function there instead of starting Ray tasks
(runtime/hosting/executor.py: `use_task_hosts`). The tokenizer cache (engines/fitting.py) is per process, so the second job
of a model measures with the tokenizer the first one loaded.

The runtime is one machine (`nightshift up` starts a local Ray), so the hosts run where the job's disk is. A host
that dies is restarted by Ray and its call retried (every task's writes are idempotent, as with Ray tasks)."""

from __future__ import annotations

from typing import Any

HOSTS_SUFFIX = "-tasks"
MAX_HOSTS = 64  # how far `find_task_hosts` looks


def host_name(owner: str, index: int) -> str:
    return f"{owner}{HOSTS_SUFFIX}-{index}"


class TaskHost:
    """One process that runs task functions `fn(context, item)`, one at a time, job after job."""

    def __init__(self) -> None:
        # What every ingest and finalize task imports, imported once here rather than in each job's first task.
        import pipeline.runtime.commit.finalize  # noqa: F401
        import pipeline.runtime.ingest.tasks  # noqa: F401

        try:
            import transformers  # noqa: F401 - the tokenizer's libraries: the bulk of a fresh worker's imports
            from transformers import AutoTokenizer  # noqa: F401 - a lazy module: this import is the slow one
        except ImportError:
            pass

    def ready(self) -> int:
        """This host's process id, once its imports are done."""
        import os

        return os.getpid()

    def run(self, fn: Any, context: Any, item: Any) -> tuple[str, Any, dict[str, int]]:
        from pipeline.runtime.hosting.executor import _task

        return _task(fn, context, item)


def start_task_hosts(owner: str, count: int, namespace: str) -> list[Any]:
    """`count` task hosts named after `owner`, owned by the caller, who must hold the handles returned for as long
    as the hosts should live; returns when each has done its imports."""
    import ray

    from pipeline.runtime.hosting.executor import MAX_RETRIES

    hosts = [
        ray.remote(num_cpus=0)(TaskHost)
        .options(
            name=host_name(owner, index),
            namespace=namespace,
            max_restarts=-1,
            max_task_retries=MAX_RETRIES,
            get_if_exists=True,
        )
        .remote()
        for index in range(count)
    ]
    ray.get([host.ready.remote() for host in hosts])
    return hosts


def stop_task_hosts(hosts: list[Any], timeout_s: float = 10.0) -> None:
    """End the hosts and wait (up to `timeout_s`) until their processes are gone. Call it while Ray still runs:
    Ray's node processes reap them then, where a host still exiting when Ray itself shuts down outlives its parent
    and, in a container whose first process reaps nothing, stays a zombie."""
    import psutil
    import ray

    try:
        pids = ray.get([host.ready.remote() for host in hosts], timeout=timeout_s)
    except Exception:  # noqa: BLE001 - a host that cannot answer is ended all the same
        pids = []
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    for host in hosts:
        ray.kill(host, no_restart=True)
    psutil.wait_procs(processes, timeout=timeout_s)


def find_task_hosts(owner: str, namespace: str) -> list[Any]:
    """The task hosts a runtime keeps under `owner`'s name; none when it keeps none."""
    import ray

    hosts = []
    for index in range(MAX_HOSTS):
        try:
            hosts.append(ray.get_actor(host_name(owner, index), namespace=namespace))
        except ValueError:
            break
    return hosts
