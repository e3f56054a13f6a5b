from __future__ import annotations

import os
import time

import pytest

# The local Ray instance `local_ray` started: its address, and the environment its workers inherited (e.g. the S3
# test credentials the moto_s3 fixture sets, which tasks only see when they were set before Ray started).
_OURS: dict = {}
# Ray Data's own actors, one per instance: up from the first dataset on, as within a module.
_RAY_DATA_ACTORS = {"datasets_stats_actor", "AutoscalingCoordinator", "ActorLocationTracker"}


def _environ() -> dict[str, str]:
    """The process environment, but for pytest's note of the test that is running."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def _ours_is_running() -> bool:
    import ray

    if not (_OURS and ray.is_initialized()):
        return False
    try:
        return ray.get_runtime_context().gcs_address == _OURS["address"]
    except Exception:  # noqa: BLE001 - whatever is running, it is not known to be ours
        return False


def _clean(timeout_s: float = 5.0) -> bool:
    """Whether the instance is as a fresh one would be: no actor of an earlier job alive (Ray Data's own aside),
    and every resource a task or actor asks for free again (Ray reports both a moment after the actors are gone)."""
    import ray
    from ray._private import state

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            actors_gone = all(
                a["State"] == "DEAD" or a.get("Name") in _RAY_DATA_ACTORS for a in state.actors().values()
            )
            total, free = ray.cluster_resources(), ray.available_resources()
        except Exception:  # noqa: BLE001 - what cannot be checked is not known to be clean
            return False
        resources_free = all(
            free.get(k, 0) >= v
            for k, v in total.items()
            if k != "object_store_memory" and not k.startswith("node:")
        )
        if actors_gone and resources_free:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


# The test this process runs after the one being torn down (pytest knows it then; with pytest-xdist it is the next
# test of this worker, not of the whole collection).
_NEXT_ITEM: dict = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    _NEXT_ITEM["item"] = nextitem
    yield


def _next_module_uses_local_ray(request: pytest.FixtureRequest) -> bool:
    later = _NEXT_ITEM.get("item")
    return later is not None and later.module is not request.module and "local_ray" in later.fixturenames


@pytest.fixture(scope="module")
def local_ray(request):
    """A private local Ray instance (jobs reuse an initialized Ray). Each module starts from a clean slate: the
    instance is handed on to the next module only when that one wants it too, and only while it is as a fresh
    start would make it (no actor alive, every resource free); else it is shut down at the module's end, and
    Ray starts afresh for a module whose environment differs from the one Ray's workers inherited. Modules which
    build their own multi-node cluster shut down whatever runs first."""
    import ray

    if not (_ours_is_running() and _environ() == _OURS["environ"]):
        if ray.is_initialized():
            ray.shutdown()
        context = ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        _OURS.update(address=context.address_info["gcs_address"], environ=_environ())
    yield
    if not (_next_module_uses_local_ray(request) and _ours_is_running() and _clean()):
        ray.shutdown()
        _OURS.clear()
