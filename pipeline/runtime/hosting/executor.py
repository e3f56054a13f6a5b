"""How a job's cluster tasks run: one plain function of (context, item) per item, as Ray tasks or in this process.

Ingest (runtime/ingest/tasks.py: scan, read, dedup, fix) and finalize (runtime/commit/finalize.py: key, cut, map,
reduce) cut their work into items and hand `TaskExecutor.map` a task function, the context every task shares and
the items. Where each call runs:
- in this process (the driver), one after another, when Ray is not initialized (unit tests, tools) or the caller
  asks for it; no Ray is imported;
- as Ray tasks when Ray is initialized (`ray_placement`): pinned to the driver's node when the work reads or writes
  the driver's disk and the cluster spans hosts (`runtime/locality.py`), else wherever Ray's SPREAD strategy finds
  room. The context goes to the object store once per map, not once per task.

Either way the results come back in the order of the items, `on_result` sees each as soon as its task is done, the
caller may count the nodes the tasks ran on, and a task that fails raises its own exception in the driver (not
Ray's wrapper). The storage retries a task makes in its worker are added to the driver's `RetryStats`, which the
manifest reports.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.io.locations import RetryStats
from pipeline.runtime.locality import must_pin_to_driver

IN_PROCESS = "local"  # the placement of a task that ran in this process
MAX_RETRIES = 3  # Ray runs a task again after its worker or node died: every task's writes are idempotent

# The warm runtime's task hosts (runtime/hosting/task_hosts.py) this driver sends its tasks to, when its job runs on one.
_task_hosts: list[Any] = []


def use_task_hosts(hosts: Sequence[Any]) -> None:
    """From now on, this driver's executors on Ray run their tasks on `hosts` (actors that stay warm between
    jobs) instead of as Ray tasks; an empty list goes back to Ray tasks."""
    _task_hosts[:] = list(hosts)


@dataclass(frozen=True)
class TaskPlacement:
    """Where a job's Ray tasks go (decided once per executor, from the cluster's node list)."""

    node: str | None  # the driver's node id when the tasks are pinned to it; None: wherever Ray finds room
    cpus: float  # the CPUs Ray offers the tasks: that node's, or the whole cluster's
    driver_address: str | None  # the driver's node address (its host)


def place_tasks(
    touches_driver_disk: bool, nodes: Sequence[Mapping[str, Any]], driver: str, cluster_cpus: float
) -> TaskPlacement:
    """Pure: where tasks go, given `ray.nodes()`, the driver's node id and the cluster's CPUs. Work that touches a
    path on the driver's disk is pinned to the driver's node when another host could not reach that disk."""
    here = next((n for n in nodes if n.get("NodeID") == driver), {})
    address = here.get("NodeManagerAddress")
    if must_pin_to_driver(touches_driver_disk, nodes, driver):
        return TaskPlacement(driver, float(here.get("Resources", {}).get("CPU", 0)), address)
    return TaskPlacement(None, cluster_cpus, address)


def running_ray() -> Any | None:
    """The ray module when Ray is initialized in this process, else None (never imports it: no second spent)."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


def ray_placement(touches_driver_disk: bool) -> TaskPlacement | None:
    """Where tasks go on the cluster this driver is connected to; None without Ray (the tasks run in this process)."""
    ray = running_ray()
    if ray is None:
        return None
    return place_tasks(
        touches_driver_disk,
        ray.nodes(),
        ray.get_runtime_context().get_node_id(),
        float(ray.cluster_resources().get("CPU", 0)),
    )


def _task(fn: Callable[[Any, Any], Any], context: Any, item: Any) -> tuple[str, Any, dict[str, int]]:
    """A Ray task: `fn(context, item)`, the node it ran on, and the storage retries it made (counted per process, so
    the driver adds them to its own count)."""
    import ray

    before = RetryStats.snapshot()
    value = fn(context, item)
    return ray.get_runtime_context().get_node_id(), value, RetryStats.since(before)["by_operation"]


class TaskExecutor:
    """Runs `fn(context, item)` for every item: as Ray tasks placed by `placement`, or in this process when it is
    None.

    On Ray a task takes one CPU, unless `reserve_cpus` is off or the place offers no whole CPU (a head started with
    num-cpus 0 that keeps the driver): then it takes none, so it can run at all — engines may hold every CPU (a CPU
    pool takes every core; warm engines keep theirs while idle), and a task waiting for one would wait for them.
    Either way at most twice the place's CPUs of tasks are submitted at once: Ray holds the rest back, and a
    zero-CPU task would not wait for a free core.

    A failure: by default nothing more is submitted, the tasks in flight are left to settle, unrecorded, and the
    failure is raised (`keep_going` off: the work is redone from the start anyway). They are not cancelled:
    Ray 2.60's `ray.cancel` races a task's own reply and then aborts this whole process ("Tried to complete task
    that was not pending", ray-project/ray#54846), and at most twice the place's CPUs of them are in flight. With
    `keep_going`, every task still runs and settles first, then the first failure (in item order) is raised: work
    that finished is recorded, so a resume has less to redo. In this process the first failure stops the loop
    either way."""

    def __init__(
        self, placement: TaskPlacement | None = None, reserve_cpus: bool = True, keep_going: bool = False
    ) -> None:
        self.placement = placement
        self.keep_going = keep_going
        self._shipped: tuple[Any, Any] | None = None  # (context, its object ref): the last context put
        if placement is None:
            self.parallelism = 1  # tasks that run at once
            self.in_flight = 1
            self.where = "in the driver"  # for the log
            self._remote: Any = None
            return
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._hosts = list(_task_hosts)
        self._host_load = [0] * len(self._hosts)  # calls in flight on each host
        self.parallelism = len(self._hosts) or max(1, int(placement.cpus))
        # On hosts, one call each: a call queued behind a task that kills its host would be retried with it, and
        # could fail in its place.
        self.in_flight = self.parallelism if self._hosts else 2 * self.parallelism
        strategy: Any = "SPREAD"
        self.where = "spread over the cluster"
        if placement.node is not None:
            strategy = NodeAffinitySchedulingStrategy(placement.node, soft=False)
            self.where = "on the driver's node"
        self._remote = ray.remote(_task).options(
            num_cpus=1 if reserve_cpus and placement.cpus >= 1 else 0,
            max_retries=MAX_RETRIES,
            scheduling_strategy=strategy,
        )
        if self._hosts:
            self.where = f"on the warm runtime's {len(self._hosts)} task hosts"

    @property
    def on_ray(self) -> bool:
        return self._remote is not None

    def map(
        self,
        fn: Callable[[Any, Any], Any],
        context: Any,
        items: Sequence[Any],
        on_result: Callable[[Any], None] | None = None,
        tasks_by_node: Counter[str] | None = None,
    ) -> list[Any]:
        """`fn(context, item)` for every item; the results in the order of `items`. `on_result` sees each result as
        soon as its task is done; `tasks_by_node` counts the tasks each node ran (a Ray node id, or
        IN_PROCESS)."""
        if self._remote is None:
            results = []
            for item in items:
                results.append(fn(context, item))
                if tasks_by_node is not None:
                    tasks_by_node[IN_PROCESS] += 1
                if on_result is not None:
                    on_result(results[-1])
            return results
        return self._map_on_ray(fn, context, items, on_result, tasks_by_node)

    def _map_on_ray(
        self,
        fn: Callable[[Any, Any], Any],
        context: Any,
        items: Sequence[Any],
        on_result: Callable[[Any], None] | None,
        tasks_by_node: Counter[str] | None,
    ) -> list[Any]:
        import ray

        if self._shipped is None or self._shipped[0] is not context:
            self._shipped = (context, ray.put(context))  # shipped once, not once per task
        shared = self._shipped[1]
        results: list[Any] = [None] * len(items)
        index_of: dict[Any, int] = {}
        host_of: dict[Any, int] = {}
        pending: list[Any] = []
        failures: dict[int, BaseException] = {}

        def settle(done: list[Any]) -> None:
            for ref in done:
                if ref in host_of:
                    self._host_load[host_of.pop(ref)] -= 1
                try:
                    node, value, retries = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    error = _cause(exc)
                    if not self.keep_going:
                        if pending:  # see the class docstring: never cancelled
                            ray.wait(pending, num_returns=len(pending))
                        raise error from None
                    failures[index_of[ref]] = error
                    continue
                RetryStats.add(retries)  # the job's storage statistics include what its tasks retried
                if tasks_by_node is not None:
                    tasks_by_node[node] += 1
                results[index_of[ref]] = value
                if on_result is not None:
                    on_result(value)

        for index, item in enumerate(items):
            if len(pending) >= self.in_flight:
                done, pending = ray.wait(pending, num_returns=1)
                settle(done)
            if self._hosts:  # an idle host (in_flight is one call per host)
                host = min(range(len(self._hosts)), key=self._host_load.__getitem__)
                ref = self._hosts[host].run.remote(fn, shared, item)
                self._host_load[host] += 1
                host_of[ref] = host
            else:
                ref = self._remote.remote(fn, shared, item)
            index_of[ref] = index
            pending.append(ref)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            settle(done)
        if failures:
            raise failures[min(failures)]
        return results


def _cause(exc: BaseException) -> BaseException:
    """The task's own exception for a task that raised one; Ray's error otherwise (a worker or node lost for good)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc
