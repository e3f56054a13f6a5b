"""README "Failure model", row "a worker node leaves the cluster": a worker node that hosts an engine with chunks in
flight is lost abruptly mid-job (its raylet and every process on it SIGKILLed at once, no drain) in a 3-node local
Ray cluster. Its engine is restarted on another node, the rows it had in flight run again there, and the output is
still exactly once with full accounting."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.local import NodeSpec, mixed_cluster
from pipeline.config import JobConfig
from pipeline.runtime.job import run_job
from tests.failure_figures import record
from tests.lines import chat_line, read_jsonl, write_lines

pytestmark = pytest.mark.slow

WORKERS = ("worker-a", "worker-b")


@pytest.fixture
def three_node_cluster():
    import ray

    # Each node offers one engine slot; two engines run, the third slot is where a lost engine comes back.
    if ray.is_initialized():  # a job earlier in this process left its local Ray running
        ray.shutdown()
    specs = [NodeSpec(name=name, num_cpus=1, resources={"engine_slot": 1}) for name in ("head", *WORKERS)]
    with mixed_cluster(specs) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield cluster
        finally:
            ray.shutdown()


def test_worker_node_with_work_in_flight_lost_mid_job(three_node_cluster, tmp_path):
    import ray

    cluster = three_node_cluster
    n = 1500
    path = write_lines(tmp_path / "in.jsonl", [chat_line(f"r-{i:05d}", f"q {i}") for i in range(n)])
    config = JobConfig.model_validate(
        {
            "input": str(path),
            "output": str(tmp_path / "out"),
            "job_id": "node-loss",
            "engine": {
                "backend": "fake",
                # 0.4 s a request, 32 at once per engine: every engine always has chunks in flight.
                "fake": {"output_tokens": 4, "decode_seconds_per_token": 0.1, "max_concurrency": 32},
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

    def job() -> None:
        try:
            outcome["result"] = run_job(config, show_progress=False)
        except Exception as exc:  # noqa: BLE001 - shown by the assertion below
            outcome["error"] = exc

    thread = threading.Thread(target=job)
    thread.start()

    # Wait until an engine on a worker node has rows in flight (the monitor's work ledger: begun, not returned),
    # then lose that node.
    worker_nodes = {cluster.node_ids[name]: name for name in WORKERS}
    deadline = time.monotonic() + 120
    victim = None
    work: dict = {}
    while victim is None:
        assert time.monotonic() < deadline and thread.is_alive(), (
            f"no engine on a worker node got work: {outcome}, last seen {work if victim is None else ''}"
        )
        try:
            monitor = ray.get_actor("nightshift-monitor-node-loss")
            work = ray.get(monitor.work.remote())
        except ValueError:  # the monitor is not up yet
            work = {}
        victim = next(
            (
                e
                for e, w in work.items()
                if w["node_id"] in worker_nodes and w["in_flight"] > 0 and w["finished"]
            ),
            None,
        )
        time.sleep(0.05)
    victim_node = work[victim]["node_id"]
    in_flight_seen = work[victim]["in_flight"]
    cluster.kill_node(worker_nodes[victim_node])

    thread.join(timeout=600)
    assert not thread.is_alive()
    result = outcome["result"]
    rows = read_jsonl(result.output.glob("results-*.jsonl"))
    errors = read_jsonl(result.output.glob("errors-*.jsonl"))
    record(
        "worker node with rows in flight killed (3-node cluster)",
        injected=1,
        input_lines=n,
        output_ids=[r["custom_id"] for r in rows + errors],
    )
    # Exactly once, full accounting.
    assert errors == []
    assert len(rows) == n == result.manifest["counts"]["total"]
    assert sorted(r["custom_id"] for r in rows) == [f"r-{i:05d}" for i in range(n)]
    # The runtime's own record: the engine on the lost node died with rows in flight (it reported no cause: it
    # was killed with its node), and those rows ran again on engines on other nodes.
    recovery = result.manifest["recovery"]
    assert list(recovery["engines_lost"]) == [victim]
    lost = recovery["engines_lost"][victim]
    assert lost["node_id"] == victim_node and lost["cause"] is None
    assert lost["rows_in_flight"] >= 1 and in_flight_seen >= 1
    # Every row in flight there ran again; so may chunks it had finished whose output was still on the lost node.
    assert lost["rows_rerun"] == sum(r["rows"] for r in lost["rerun_on"]) >= lost["rows_in_flight"]
    assert all(r["node_id"] not in (None, victim_node) for r in lost["rerun_on"])
    assert recovery["requests_retried_after_engine_failure"] == lost["rows_rerun"]
    assert recovery["engine_restarts"] == 1
