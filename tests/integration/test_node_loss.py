"""A worker node leaves a 3-node local Ray cluster mid-job: its engine is restarted elsewhere and its in-flight
batches re-run; the output is still exactly once."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.config import JobConfig
from pipeline.runtime.job import run_job
from tests.conftest import chat_line, read_jsonl, write_lines
from tests.failure_figures import record

pytestmark = pytest.mark.slow


@pytest.fixture
def three_node_cluster():
    import ray
    from ray.cluster_utils import Cluster

    # Each node offers one engine slot; two engines run, the third slot is where a lost engine comes back.
    if ray.is_initialized():  # a job earlier in this process left its local Ray running
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"engine_slot": 1}})
    workers = [cluster.add_node(num_cpus=1, resources={"engine_slot": 1}) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


def test_worker_node_removed_mid_job(three_node_cluster, tmp_path):
    import ray

    cluster, workers = three_node_cluster
    n = 1500
    path = write_lines(tmp_path / "in.jsonl", [chat_line(f"r-{i:05d}", f"q {i}") for i in range(n)])
    config = JobConfig.model_validate(
        {
            "input": str(path),
            "output": str(tmp_path / "out"),
            "job_id": "node-loss",
            "engine": {
                "backend": "fake",
                "fake": {"output_tokens": 4, "decode_seconds_per_token": 0.05, "max_concurrency": 32},
            },
            "resources": {
                "num_engines": 2,
                "cpus_per_engine": 0,
                "resources_per_engine": {"engine_slot": 1},
                "rows_per_task": 8,
            },
            "output_options": {"rows_per_shard": 500, "staging_rows": 100},
        }
    )
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=run_job(config, show_progress=False)))
    thread.start()

    # Wait until both engines report, then remove the worker node that hosts one of them.
    deadline = time.monotonic() + 120
    victim = None
    while victim is None:
        assert time.monotonic() < deadline and thread.is_alive(), "engines never started"
        try:
            engines = ray.get(ray.get_actor("nightshift-monitor-node-loss").snapshot.remote())
        except ValueError:  # the monitor is not up yet
            engines = {}
        pids = {info["pid"] for info in engines.values()}
        for node in workers:
            if any(pid in pids for pid in _node_worker_pids(node)):
                victim = node
        time.sleep(0.5)
    time.sleep(2)  # let it get work in flight
    cluster.remove_node(victim)

    thread.join(timeout=600)
    assert not thread.is_alive()
    result = outcome["result"]
    rows = read_jsonl(result.output.glob("results-*.jsonl"))
    errors = read_jsonl(result.output.glob("errors-*.jsonl"))
    record(
        "worker node removed from a 3-node cluster",
        injected=1,
        input_lines=n,
        output_ids=[r["custom_id"] for r in rows + errors],
    )
    assert len(rows) == n
    assert len({r["custom_id"] for r in rows}) == n
    assert result.manifest["counts"]["total"] == n


def _node_worker_pids(node) -> set[int]:
    import psutil

    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    return {child.pid for child in raylet.children(recursive=True)}
