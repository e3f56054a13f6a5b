"""Sharded engines placed as whole placement groups, on a local cluster of several raylets with one (simulated)
GPU each: the fake engine's ranks stand in for vLLM's Ray workers (engines/fake_ranks.py), one per bundle.

- A PP=2 engine's two stages land on two nodes, rank 0 beside the engine actor; every row answered once.
- The node holding stage 1 is lost mid-job: Ray re-creates that bundle on the spare node, the engine is rebuilt
  with both ranks, its rows run again, exactly once.
- A TP=2 engine, whose ranks must share a node, on nodes of one GPU each: refused before any work, naming the
  nodes and what they offer.

vLLM's CPU backend cannot span nodes (it has no Ray executor), so stages on two raylets are tested here with the
fake engine; tests/e2e/test_parallel_real_engine.py runs real TP=2 and PP=2 engines on one node.
"""

from __future__ import annotations

import threading
import time

import pytest

from cluster.local import NodeSpec, mixed_cluster
from pipeline.config import JobConfig
from pipeline.runtime.job import run_job
from pipeline.runtime.preflight import PreflightError
from tests.failure_figures import record
from tests.lines import chat_line, read_jsonl, write_lines

pytestmark = pytest.mark.slow

GPU_NODES = ("gpu-a", "gpu-b", "gpu-c")


@pytest.fixture(scope="module")
def gpu_nodes():
    """A head for the driver's tasks and three nodes of one GPU each: an engine of two stages takes two of them,
    the third is where a lost stage comes back. One cluster for the module (four raylets are a start of many
    seconds on a small box); each test leaves no group behind, which the tests after it would find."""
    import ray

    if ray.is_initialized():  # a job earlier in this process left its local Ray running
        ray.shutdown()
    specs = [NodeSpec(name="head", num_cpus=2)] + [
        NodeSpec(name=n, num_cpus=1, num_gpus=1) for n in GPU_NODES
    ]
    with mixed_cluster(specs) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield cluster
        finally:
            ray.shutdown()


def _config(tmp_path, job_id: str, n: int, fake: dict) -> JobConfig:
    path = write_lines(tmp_path / "in.jsonl", [chat_line(f"r-{i:04d}", f"q {i}") for i in range(n)])
    return JobConfig.model_validate(
        {
            "input": str(path),
            "output": str(tmp_path / "out"),
            "job_id": job_id,
            "engine": {"backend": "fake", "fake": {"output_tokens": 4, "max_concurrency": 16, **fake}},
            "resources": {"num_engines": 1, "gpus_per_engine": 2, "cpus_per_engine": 1, "rows_per_task": 8},
            "output_options": {"rows_per_shard": 100, "staging_rows": 20},
        }
    )


def test_a_pp2_engine_puts_its_stages_on_two_nodes(gpu_nodes, tmp_path):
    n = 64
    result = run_job(_config(tmp_path, "pp-two-nodes", n, {"pipeline_parallel_size": 2}), show_progress=False)

    rows = read_jsonl(result.output.glob("results-*.jsonl"))
    assert len(rows) == n == result.manifest["counts"]["succeeded"]
    groups = result.manifest["placement"]["engine_groups"]["default"]
    assert len(groups) == 1
    (bundle_nodes,) = groups
    gpu_node_ids = {gpu_nodes.node_ids[name] for name in GPU_NODES}
    assert len(bundle_nodes) == 2 and len(set(bundle_nodes)) == 2 and set(bundle_nodes) <= gpu_node_ids
    # Each rank was told its place as vLLM tells its workers, and ran in its own bundle; the engine actor sits in
    # bundle 0, beside stage 0.
    (engine,) = result.manifest["engine"]["per_engine"].values()
    ranks = result.manifest["engine"]["args"]["ranks"]
    assert [(r["rank"], r["stage"], r["tensor_rank"], r["world"]) for r in ranks] == [
        (0, 0, 0, 2),
        (1, 1, 0, 2),
    ]
    assert [r["node_id"] for r in ranks] == bundle_nodes
    assert engine["node_id"] == bundle_nodes[0]
    # The group is removed with the job.
    from ray.util.placement_group import placement_group_table

    assert all(
        g["state"] == "REMOVED" for g in placement_group_table().values() if "pp-two-nodes" in g["name"]
    )


def test_tensor_ranks_that_no_node_can_hold_together_are_refused_before_any_work(gpu_nodes, tmp_path):
    config = _config(tmp_path, "tp-too-wide", 8, {"tensor_parallel_size": 2})
    with pytest.raises(PreflightError) as refused:
        run_job(config, show_progress=False)
    message = str(refused.value)
    assert message.startswith(
        "pool default: its engines (TP=2 PP=1) cannot be placed on this cluster: an engine needs CPU 1, GPU 2 on "
        "one node (2 ranks packed together); nodes: "
    )
    for name in GPU_NODES:
        assert f"{gpu_nodes.node_ids[name][:8]}: CPU 1, GPU 1" in message
    assert not list((tmp_path / "out").glob("results-*"))


def test_a_warm_sharded_engine_keeps_its_group_between_jobs_and_gives_it_back_when_stopped(
    gpu_nodes, tmp_path
):
    """Engines kept by the Batch API server's keeper (runtime/engines/warm_keeper.py): a sharded one reserves its
    group as the keeper starts it, keeps it while it waits for the next job, and the group goes when the engine
    is stopped (idle here)."""
    import ray
    from ray.util.placement_group import placement_group_table

    from pipeline.runtime.engines.warm_keeper import start_keeper

    keeper = start_keeper("groups-keeper", idle_seconds=15)  # outlasts the gap between the two jobs
    ray.get(keeper.describe.remote())

    def warm_groups() -> list[dict]:
        return [g for g in placement_group_table().values() if g["name"].startswith("nightshift-warm-")]

    manifests = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        config = _config(tmp_path / name, name, 24, {"pipeline_parallel_size": 2})
        config = config.model_copy(
            update={"engine": config.engine.model_copy(update={"warm_engines": "groups-keeper"})}
        )
        manifests.append(run_job(config, show_progress=False).manifest)
        (group,) = [g for g in warm_groups() if g["state"] == "CREATED"]  # one engine, one group, still there
        assert len(set(group["bundles_to_node_id"].values())) == 2
    assert [m["engine"]["reused"] for m in manifests] == [0, 1]
    assert all(m["counts"]["succeeded"] == 24 for m in manifests)

    deadline = time.monotonic() + 90
    while any(g["state"] != "REMOVED" for g in warm_groups()):
        assert time.monotonic() < deadline, warm_groups()
        time.sleep(0.5)
    ray.kill(keeper)


# Last in the module: it loses a node of the cluster the tests above share.
def test_the_node_of_a_pipeline_stage_lost_mid_job(gpu_nodes, tmp_path):
    import ray
    from ray.util.placement_group import placement_group_table

    n = 400
    config = _config(
        tmp_path, "stage-lost", n, {"pipeline_parallel_size": 2, "decode_seconds_per_token": 0.1}
    )
    outcome: dict = {}

    def job() -> None:
        try:
            outcome["result"] = run_job(config, show_progress=False)
        except Exception as exc:  # noqa: BLE001 - shown by the assertion below
            outcome["error"] = exc

    thread = threading.Thread(target=job)
    thread.start()

    # Once the engine has rows in flight, lose the node holding its stage 1 (not the engine actor's).
    deadline = time.monotonic() + 120
    stage_node = None
    while stage_node is None:
        assert time.monotonic() < deadline and thread.is_alive(), f"the engine never got work: {outcome}"
        try:
            work = ray.get(ray.get_actor("nightshift-monitor-stage-lost").work.remote())
        except ValueError:
            work = {}
        groups = [g for g in placement_group_table().values() if "stage-lost" in g["name"]]
        if groups and any(w["in_flight"] > 0 and w["finished"] for w in work.values()):
            stage_node = groups[0]["bundles_to_node_id"][1]
        time.sleep(0.05)
    names = {node_id: name for name, node_id in gpu_nodes.node_ids.items()}
    gpu_nodes.kill_node(names[stage_node])

    thread.join(timeout=600)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome
    result = outcome["result"]
    rows = read_jsonl(result.output.glob("results-*.jsonl"))
    errors = read_jsonl(result.output.glob("errors-*.jsonl"))
    record(
        "node of a PP=2 engine's second stage killed (fake engine, 4-node cluster)",
        injected=1,
        input_lines=n,
        output_ids=[r["custom_id"] for r in rows + errors],
    )
    assert errors == []
    assert len(rows) == n == result.manifest["counts"]["total"]
    assert sorted(r["custom_id"] for r in rows) == [f"r-{i:04d}" for i in range(n)]
    # The whole engine went with its stage (the engine reported its rank lost), was rebuilt in its group, whose
    # lost bundle Ray placed on the spare node, and the rows it had in flight ran again.
    recovery = result.manifest["recovery"]
    # (A restart that came up before Ray had moved the lost bundle found its rank dead as it started: that engine
    # is lost too, with no rows in flight, and the next restart runs.)
    losses = recovery["engines_lost"].values()
    assert {loss["cause"] for loss in losses} == {"RankLost"}
    (lost,) = [loss for loss in losses if loss["rows_in_flight"]]
    assert lost["rows_rerun"] >= lost["rows_in_flight"]
    assert recovery["engine_restarts"] >= 1
    (bundle_nodes,) = result.manifest["placement"]["engine_groups"]["default"]
    assert stage_node not in bundle_nodes and len(set(bundle_nodes)) == 2
