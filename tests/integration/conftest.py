from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def local_ray():
    """One private local Ray instance for the integration tests (jobs reuse an initialized Ray)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
