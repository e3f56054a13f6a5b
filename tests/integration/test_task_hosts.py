"""The warm runtime's task hosts on a real local Ray: an executor that uses them runs every task there (and nowhere
else), keeps the results in item order, spreads the work over the hosts, and survives a host that dies mid-map;
without them, it runs Ray tasks again. (A run on `nightshift up` using them: tests/integration/test_up_run_down.py.)"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from pipeline.runtime.hosting.executor import TaskExecutor, ray_placement, use_task_hosts
from pipeline.runtime.hosting.task_hosts import find_task_hosts, start_task_hosts

pytestmark = pytest.mark.slow

NAMESPACE = "nightshift-test-task-hosts"


def setup_module() -> None:
    # The task functions below travel by value: the hosts' processes cannot import this test module by name.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def teardown_module() -> None:
    from ray import cloudpickle

    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def pid_of(context: dict, item: int) -> tuple[int, int]:
    """A task: its item, and the process it ran in."""
    time.sleep(context["sleep"])
    return item, os.getpid()


def dies_once(context: dict, item: int) -> tuple[int, int]:
    """A task whose first call on item 3 kills its process (a host lost mid-map)."""
    marker = Path(context["marker"])
    if item == 3 and not marker.exists():
        marker.write_text("died")
        os._exit(1)
    return item, os.getpid()


@pytest.fixture
def hosts(local_ray):
    import ray

    started = start_task_hosts("test-owner", 2, NAMESPACE)
    try:
        yield started
    finally:
        use_task_hosts([])
        for host in started:
            ray.kill(host)


def test_tasks_run_on_the_hosts_in_item_order(hosts):
    import ray

    found = find_task_hosts("test-owner", NAMESPACE)
    assert len(found) == 2
    host_pids = set(ray.get([h.__ray_call__.remote(lambda self: os.getpid()) for h in found]))
    use_task_hosts(found)
    run = TaskExecutor(ray_placement(False))
    assert run.parallelism == 2 and "task hosts" in run.where
    by_node: Counter[str] = Counter()
    seen: list[int] = []
    results = run.map(pid_of, {"sleep": 0.05}, list(range(12)), lambda r: seen.append(r[0]), by_node)
    assert [item for item, _ in results] == list(range(12))
    assert sorted(seen) == list(range(12))
    pids = Counter(pid for _, pid in results)
    assert set(pids) == host_pids  # every task on a host, and both hosts worked
    assert sum(by_node.values()) == 12

    # The same processes serve the next map (and the next job): that is what keeps them warm.
    again = TaskExecutor(ray_placement(False)).map(pid_of, {"sleep": 0}, [0, 1, 2, 3])
    assert {pid for _, pid in again} <= host_pids

    use_task_hosts([])
    plain = TaskExecutor(ray_placement(False))
    assert "task hosts" not in plain.where
    assert not {pid for _, pid in plain.map(pid_of, {"sleep": 0}, [0, 1, 2, 3])} & host_pids


def test_a_host_that_dies_mid_map_is_restarted_and_its_task_run_again(hosts, tmp_path):
    use_task_hosts(hosts)
    results = TaskExecutor(ray_placement(False)).map(
        dies_once, {"marker": str(tmp_path / "died")}, list(range(8))
    )
    assert (tmp_path / "died").exists()
    assert [item for item, _ in results] == list(range(8))


def test_no_hosts_under_another_owner(local_ray):
    assert find_task_hosts("nobody", NAMESPACE) == []
