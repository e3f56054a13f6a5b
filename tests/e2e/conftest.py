from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

NIGHTSHIFT = [sys.executable, "-m", "pipeline"]


def run_cli(*args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real `nightshift` command line in a subprocess, as users do."""
    return subprocess.run(
        [*NIGHTSHIFT, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


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
