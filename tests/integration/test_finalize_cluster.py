"""Finalize on a multi-node Ray cluster (three raylets on this machine, one CPU each): its tasks spread over the
nodes when every node reaches the files (one host, or S3 via moto), run only on the driver's node when a local
path meets a cluster of several hosts, and write the same bytes as finalize without Ray."""

# ruff: noqa: F811 - pytest fixtures imported from storage_fixtures are re-bound as test arguments

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cluster.local import NodeSpec, mixed_cluster
from pipeline.config import StorageConfig
from pipeline.io.staging import StagingArea
from pipeline.io.writers import output_target
from pipeline.runtime.commit import finalize as finalize_module
from pipeline.runtime.commit.finalize import FinalizeOutputs, commit, write_outputs
from pipeline.runtime.hosting import executor as executor_module
from tests.integration.storage_fixtures import moto_s3  # noqa: F401
from tests.staged_rows import error_row, result_row, stage_randomly, unicode_ids

pytestmark = pytest.mark.slow

RESULTS, ERRORS, ROWS_PER_SHARD = 1500, 40, 150  # 10 result shards, 1 error shard


@pytest.fixture(scope="module")
def cluster(moto_s3):  # moto first: the raylets (and so the tasks) inherit its AWS_* test credentials
    import ray

    if ray.is_initialized():
        ray.shutdown()
    with mixed_cluster([NodeSpec.cpu("head"), NodeSpec.cpu("a"), NodeSpec.cpu("b")]) as local:
        ray.init(address=local.address, log_to_driver=False)
        try:
            every_node_runs_a_task(local)
            yield local
        finally:
            ray.shutdown()


def every_node_runs_a_task(local) -> None:
    """Wait until each node has run a task of its own. A node counts as joined once it registers, but the head
    schedules by the resources the other raylets have reported to it since: on a busy box (another test process
    beside this one) the first SPREAD tasks all landed on the head, its peers not yet seen as free."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=1)
    def where() -> str:
        return ray.get_runtime_context().get_node_id()

    ran = ray.get(
        [
            where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
            for node_id in local.node_ids.values()
        ],
        timeout=120,
    )
    assert sorted(ran) == sorted(local.node_ids.values())


def stage(staging: StagingArea, part_rows: int | None = None) -> None:
    """Parts of 1-40 rows, or of `part_rows` (fewer requests to the S3 server)."""
    results = [result_row(cid) for cid in unicode_ids(RESULTS)]
    errors = [error_row(line) for line in range(1, ERRORS + 1)]
    if part_rows is None:
        stage_randomly(staging, "results", results)
        stage_randomly(staging, "errors", errors, seed=4)
        return
    for start in range(0, RESULTS, part_rows):
        staging.write_rows("results", results[start : start + part_rows])
    staging.write_rows("errors", errors)


def finalize(output, staging: StagingArea, fmt: str) -> FinalizeOutputs:
    return write_outputs(output, staging, ROWS_PER_SHARD, RESULTS + ERRORS, format=fmt)


def without_ray(monkeypatch, output, staging: StagingArea, fmt: str) -> FinalizeOutputs:
    with monkeypatch.context() as patch:
        patch.setattr(finalize_module, "ray_placement", lambda local_paths: None)
        summary = finalize(output, staging, fmt)
    assert summary.tasks_by_node.keys() == {"driver"}
    return summary


def nodes(cluster) -> dict[str, str]:
    return {node_id[:8]: name for name, node_id in cluster.node_ids.items()}


def local_files(output: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(output.iterdir()) if p.is_file()}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_one_host_spreads_the_tasks_over_its_nodes(cluster, tmp_path: Path, monkeypatch, fmt: str):
    output = tmp_path / "out"
    staging = StagingArea(output)
    staging.create()
    stage(staging)
    reference = Path(shutil.copytree(output, tmp_path / "reference"))

    summary = finalize(output, staging, fmt)

    placement = summary.tasks_by_node
    assert set(placement) <= set(nodes(cluster)) and len(placement) >= 2, placement
    assert sum(placement.values()) >= 10 + 1  # a reduce task per shard at least
    expected = without_ray(monkeypatch, reference, StagingArea(reference), fmt)
    assert summary.shards == expected.shards and summary.counts == expected.counts
    assert [s.rows for s in summary.shards.results] == [ROWS_PER_SHARD] * 10
    commit(output, staging, summary.manifest_fields())
    commit(reference, StagingArea(reference), summary.manifest_fields())
    assert local_files(output) == local_files(reference)


def test_a_local_output_across_hosts_keeps_the_tasks_on_the_drivers_node(
    cluster, tmp_path: Path, monkeypatch
):
    import ray

    monkeypatch.setattr(
        executor_module, "must_pin_to_driver", lambda local, nodes, driver: local
    )  # as if on several machines
    output = tmp_path / "out"
    staging = StagingArea(output)
    staging.create()
    stage(staging)

    summary = finalize(output, staging, "jsonl")

    driver_node = ray.get_runtime_context().get_node_id()[:8]
    assert list(summary.tasks_by_node) == [driver_node]
    assert [s.rows for s in summary.shards.results] == [ROWS_PER_SHARD] * 10


def test_s3_staging_and_output_spread_over_the_nodes(cluster, moto_s3, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path / "home"))
    storage = StorageConfig(s3_endpoint_url=moto_s3.url, retries=2, retry_backoff_s=0.01)
    bucket = moto_s3.bucket("fin")
    target = output_target(f"s3://{bucket}/run", storage)
    staging = target.staging_area()
    stage(staging, part_rows=300)
    reference_dir = tmp_path / "reference"
    reference = StagingArea(reference_dir)
    reference.create()
    stage(reference, part_rows=300)

    summary = finalize(target, staging, "jsonl")

    placement = summary.tasks_by_node
    assert set(placement) <= set(nodes(cluster)) and len(placement) >= 2, placement
    assert any("/_staging/finalize/done/" in key for key in moto_s3.keys(bucket))
    expected = without_ray(monkeypatch, reference_dir, reference, "jsonl")
    assert summary.shards == expected.shards
    commit(target, staging, summary.manifest_fields())
    keys = moto_s3.keys(bucket)
    assert not [k for k in keys if "/_staging/" in k]
    for shard in summary.shards.results + summary.shards.errors:
        assert moto_s3.get(bucket, f"run/{shard.name}") == (reference_dir / shard.name).read_bytes()
