"""A real three-raylet cluster: work asking for an accelerator tag lands on the node that advertises it."""

from __future__ import annotations

import pytest

from cluster.local import NodeSpec, mixed_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def three_nodes():
    specs = [
        NodeSpec.cpu("head"),
        NodeSpec.tagged("cuda-node", "cuda", model="NVIDIA H100 80GB HBM3", memory_mib=81559),
        NodeSpec.tagged("rocm-node", "rocm", model="AMD Instinct MI300X", memory_mib=196592),
    ]
    import ray

    if ray.is_initialized():  # a job earlier in this process left its local Ray running
        ray.shutdown()
    with mixed_cluster(specs) as cluster:
        ray.init(address=cluster.address)
        try:
            yield cluster
        finally:
            ray.shutdown()


def _where_it_ran(resources: dict[str, float]) -> str:
    import ray

    @ray.remote(num_cpus=1, resources=resources)
    def node_id() -> str:
        return ray.get_runtime_context().get_node_id()

    return ray.get(node_id.remote(), timeout=120)


def test_every_node_advertises_its_tags(three_nodes):
    import ray

    by_id = {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}
    assert by_id[three_nodes.node_ids["head"]]["accelerator:cpu"] == 1
    cuda = by_id[three_nodes.node_ids["cuda-node"]]
    assert (
        cuda["accelerator:cuda"] == 1
        and cuda["accelerator_model:H100"] == 1
        and cuda["gpu_memory_gib:80"] == 1
    )
    rocm = by_id[three_nodes.node_ids["rocm-node"]]
    assert (
        rocm["accelerator:rocm"] == 1
        and rocm["accelerator_model:MI300X"] == 1
        and rocm["gpu_memory_gib:192"] == 1
    )


def test_a_rocm_task_runs_on_the_rocm_node(three_nodes):
    assert _where_it_ran({"accelerator:rocm": 1}) == three_nodes.node_ids["rocm-node"]


def test_a_cuda_task_runs_on_the_cuda_node(three_nodes):
    assert _where_it_ran({"accelerator:cuda": 1}) == three_nodes.node_ids["cuda-node"]


def test_a_model_tag_routes_like_the_vendor_tag(three_nodes):
    assert _where_it_ran({"accelerator_model:MI300X": 1}) == three_nodes.node_ids["rocm-node"]
