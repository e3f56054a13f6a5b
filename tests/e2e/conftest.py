from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="package")
def shared_engines(tmp_path_factory, embedded_model):
    """The warm cluster of this directory's tests (tests/e2e/warm_cluster.py): jobs that join it share its engines,
    started once; stopped after the last of them (a package scope), so the later tiers get the whole box back."""
    from tests.e2e.warm_cluster import warm_cluster

    with warm_cluster(tmp_path_factory.mktemp("warm-home")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def private_ray(request):
    """A local Ray of the module's own, not the session's warm cluster: for tests whose subject is their engines'
    start and death. `PRIVATE_RAY_CPUS` in the module sets its logical CPUs (2, the box's cores, by default)."""
    import ray

    if ray.is_initialized():  # a job earlier in this process left its local Ray running
        ray.shutdown()
    cpus = getattr(request.module, "PRIVATE_RAY_CPUS", 2)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """The tiny Llama with random weights of tests/e2e/tiny_llama.py, made once per module."""
    from pipeline.models import prepare_embedded_model
    from tests.e2e.tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", prepare_embedded_model())
