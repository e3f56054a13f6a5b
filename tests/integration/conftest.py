from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def local_ray():
    """A private local Ray instance per test module (jobs reuse an initialized Ray). Per module, not per
    session, so that modules which build their own multi-node cluster start from a clean slate."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
