"""runtime.executor: task functions of (context, item) run in this process (no Ray) or as Ray tasks — results in
item order, each seen as it is done, placement counted, the task's own exception raised; where tasks go."""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from pipeline.io.locations import RetryStats
from pipeline.runtime.hosting.executor import IN_PROCESS, TaskExecutor, TaskPlacement, place_tasks


def square(context: dict, item: int) -> int:
    return context["offset"] + item * item


def record_then_maybe_fail(context: dict, item: int) -> int:
    """Leaves a file per item it ran, retries one storage operation, and fails on the items in `context["fail"]`
    (at once; the others first take `context["seconds"]`, if given)."""
    if item not in context["fail"]:
        time.sleep(context.get("seconds", 0))
    (Path(context["dir"]) / f"ran-{item}").touch()
    RetryStats.record("GET in a task")
    if item in context["fail"]:
        raise ValueError(f"item {item}")  # a builtin: the workers cannot import this module
    return item


def ran(directory: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in directory.glob("ran-*")}


# --- in this process --------------------------------------------------------------------------------------------


def test_in_process_runs_every_item_in_order_and_counts_them_here():
    executor = TaskExecutor()
    seen: list[int] = []
    placement: Counter[str] = Counter()

    results = executor.map(square, {"offset": 1}, [3, 1, 2], on_result=seen.append, tasks_by_node=placement)

    assert results == seen == [10, 2, 5]
    assert placement == {IN_PROCESS: 3}
    assert not executor.on_ray and executor.parallelism == 1 and executor.where == "in the driver"


def test_in_process_the_first_failure_stops_the_loop_and_is_raised(tmp_path: Path):
    placement: Counter[str] = Counter()
    context = {"dir": str(tmp_path), "fail": {1}}
    with pytest.raises(ValueError, match="item 1"):
        TaskExecutor(keep_going=True).map(record_then_maybe_fail, context, [0, 1, 2], tasks_by_node=placement)
    assert ran(tmp_path) == {0, 1} and placement == {IN_PROCESS: 1}


def test_no_items_no_tasks():
    assert TaskExecutor().map(square, {"offset": 0}, []) == []


# --- where Ray tasks go -----------------------------------------------------------------------------------------


def node(node_id: str, host: str, cpus: float = 1, alive: bool = True) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": host, "Alive": alive, "Resources": {"CPU": cpus}}


def test_work_on_the_drivers_disk_is_pinned_to_its_node_only_when_another_host_is_in_the_cluster():
    two_hosts = [node("d", "10.0.0.1", cpus=2), node("w", "10.0.0.2", cpus=8)]
    one_host = [node("d", "10.0.0.1", cpus=2), node("w", "10.0.0.1", cpus=8)]

    assert place_tasks(True, two_hosts, "d", 10) == TaskPlacement(
        "d", 2, "10.0.0.1"
    )  # the driver node's CPUs
    assert place_tasks(False, two_hosts, "d", 10) == TaskPlacement(None, 10, "10.0.0.1")  # the cluster's
    assert place_tasks(True, one_host, "d", 10) == TaskPlacement(None, 10, "10.0.0.1")
    gone = [node("d", "10.0.0.1"), node("w", "10.0.0.2", alive=False)]
    assert place_tasks(True, gone, "d", 1).node is None
    head_without_cpus = [node("d", "10.0.0.1", cpus=0), node("w", "10.0.0.2", cpus=8)]
    assert place_tasks(True, head_without_cpus, "d", 8) == TaskPlacement("d", 0, "10.0.0.1")


# --- on Ray (one local instance for this module) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def local_ray():
    import ray
    from ray import cloudpickle

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    # pytest imports this file under a name Ray's workers cannot import: its task functions go by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield ray
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()  # later tests would otherwise run ingest and finalize on it


def on_ray(ray, pinned: bool = False, cpus: float = 2, **options) -> TaskExecutor:
    here = ray.get_runtime_context().get_node_id()
    return TaskExecutor(TaskPlacement(here if pinned else None, cpus, None), **options)


@pytest.mark.slow
def test_ray_tasks_return_in_item_order_and_report_their_node_and_retries(local_ray, tmp_path: Path):
    executor = on_ray(local_ray, pinned=True)
    assert executor.on_ray and executor.parallelism == 2 and executor.in_flight == 4
    assert executor.where == "on the driver's node"
    seen: list[int] = []
    placement: Counter[str] = Counter()
    before = RetryStats.snapshot()

    items = list(range(9))  # more than in flight at once
    context = {"dir": str(tmp_path), "fail": set()}
    results = executor.map(
        record_then_maybe_fail, context, items, on_result=seen.append, tasks_by_node=placement
    )

    assert results == items and sorted(seen) == items
    assert placement == {local_ray.get_runtime_context().get_node_id(): 9}
    assert RetryStats.since(before)["by_operation"] == {"GET": 9}  # counted in the workers, added here


@pytest.mark.slow
def test_a_failed_ray_task_raises_its_own_exception_once_the_rest_settled_with_keep_going(
    local_ray, tmp_path: Path
):
    context = {"dir": str(tmp_path), "fail": {2, 5}}
    with pytest.raises(ValueError, match="item 2"):  # the first failure in item order, not Ray's wrapper
        on_ray(local_ray, keep_going=True).map(record_then_maybe_fail, context, list(range(8)))
    assert ran(tmp_path) == set(range(8))  # every task ran

    with pytest.raises(ValueError):
        on_ray(local_ray, cpus=0, reserve_cpus=False).map(
            record_then_maybe_fail, {**context, "fail": {0}}, [0]
        )


@pytest.mark.slow
def test_a_failed_ray_task_stops_the_submitting_and_the_tasks_in_flight_settle_before_it_is_raised(
    local_ray, tmp_path: Path
):
    """Not cancelled: Ray 2.60's cancel can race a task's reply and abort this process (ray-project/ray#54846)."""
    executor = on_ray(local_ray)
    assert executor.in_flight == 4
    context = {"dir": str(tmp_path), "fail": {0}, "seconds": 1.0}
    with pytest.raises(ValueError, match="item 0"):
        executor.map(record_then_maybe_fail, context, list(range(12)))
    assert ran(tmp_path) == {
        0,
        1,
        2,
        3,
    }  # the first four were in flight and finished; nothing more was submitted
