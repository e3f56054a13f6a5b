"""topology: the ranks of one engine — what a model lets them be (vLLM's rules, from config.json), the resources
each rank takes, the placement group an engine reserves, where a group can be placed, and each rank's cores."""

from __future__ import annotations

import pytest

from pipeline.engines.vllm_engine import omp_bind
from pipeline.model_shape import shape_from_config
from pipeline.runtime.engines.placement import Node, cpus_per_engine, engines_per_core, group_problem
from pipeline.topology import (
    Topology,
    TopologyError,
    check_pool_resources,
    check_topology,
    engine_group,
    tensor_parallel_sizes,
)

SMOLLM2 = {  # the embedded model's config.json, the keys that matter here
    "model_type": "llama",
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
}
LLAMA_70B = {
    "model_type": "llama",
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "max_position_embeddings": 131072,
}


def test_the_embedded_model_takes_only_the_tensor_parallel_sizes_that_divide_its_heads_and_mlp():
    shape = shape_from_config(SMOLLM2)
    # 9 heads: 1, 3, 9 divide them; 3 KV heads: 9 is a multiple; the MLP of 1536 = 2^9 x 3 does not divide by 9.
    assert tensor_parallel_sizes(shape) == [1, 3]
    with pytest.raises(TopologyError) as refused:
        check_topology(shape, Topology(tensor_parallel_size=2), "smollm2")
    assert str(refused.value) == (
        "smollm2: tensor_parallel_size 2 cannot shard this model: its 9 attention heads do not divide by 2. "
        "It takes tensor_parallel_size 1, 3"
    )
    with pytest.raises(TopologyError, match="MLP width 1536 does not divide by 9"):
        check_topology(shape, Topology(tensor_parallel_size=9), "smollm2")


def test_more_ranks_than_kv_heads_replicate_them_but_must_be_a_multiple():
    shape = shape_from_config(LLAMA_70B)
    check_topology(shape, Topology(tensor_parallel_size=16), "70b")  # 8 KV heads, each on two ranks
    assert tensor_parallel_sizes(shape) == [1, 2, 4, 8, 16, 32, 64]
    gqa = shape_from_config({**LLAMA_70B, "num_attention_heads": 48, "num_key_value_heads": 12})
    with pytest.raises(TopologyError, match="12 key/value heads neither divide by 8 nor divide 8"):
        check_topology(gqa, Topology(tensor_parallel_size=8), "m")


def test_pipeline_stages_split_layers_unevenly_but_never_more_stages_than_layers():
    shape = shape_from_config(SMOLLM2)
    check_topology(
        shape, Topology(pipeline_parallel_size=7), "smollm2"
    )  # 30 layers over 7 stages: uneven is fine
    with pytest.raises(TopologyError, match="31 is more stages than its 30 layers"):
        check_topology(shape, Topology(pipeline_parallel_size=31), "smollm2")


def test_topology_of_engine_args():
    assert Topology.of({}).world == 1 and not Topology.of({"tensor_parallel_size": None}).sharded
    topology = Topology.of({"tensor_parallel_size": 4, "pipeline_parallel_size": 2})
    assert topology.world == 8 and topology.sharded and str(topology) == "TP=4 PP=2"


def test_a_gpu_engine_takes_one_gpu_per_rank_and_a_cpu_engine_whole_cores_per_rank():
    tp4 = Topology(tensor_parallel_size=4)
    check_pool_resources("nvidia", tp4, 4, 1, cpu_cores=True)
    with pytest.raises(
        TopologyError,
        match=r"pools\[nvidia\]: TP=4 PP=1 is 4 ranks of one GPU each: set gpus_per_engine: 4 \(it is 1\)",
    ):
        check_pool_resources("nvidia", tp4, 1, 1, cpu_cores=True)
    tp2 = Topology(tensor_parallel_size=2)
    check_pool_resources("cpu", tp2, 0, 4, cpu_cores=True)
    check_pool_resources("cpu", tp2, 0, None, cpu_cores=True)  # left to placement, which shares them out
    with pytest.raises(TopologyError, match="cpus_per_engine 3 cannot be shared out over the 2 ranks"):
        check_pool_resources("cpu", tp2, 0, 3, cpu_cores=True)
    check_pool_resources("one", Topology(), 2, 3, cpu_cores=True)  # one rank: as before


def test_engine_groups_pack_tensor_ranks_on_one_node_and_let_gpu_pipeline_stages_span_nodes():
    gpu_tp = engine_group(
        Topology(tensor_parallel_size=4),
        cpus_per_engine=1,
        gpus_per_engine=4,
        resources={"accelerator:cuda": 4},
        accelerator_type="H100",
    )
    assert gpu_tp is not None and gpu_tp.strategy == "STRICT_PACK" and gpu_tp.executor == "ray"
    assert gpu_tp.bundles[0] == {
        "GPU": 1.0,
        "CPU": 1,
        "accelerator:cuda": 1.0,
        "accelerator_type:H100": 0.001,
    }
    assert all(
        b == {"GPU": 1.0, "accelerator:cuda": 1.0, "accelerator_type:H100": 0.001} for b in gpu_tp.bundles[1:]
    )
    assert gpu_tp.actor_resources() == {"num_cpus": 1}

    gpu_pp = engine_group(
        Topology(tensor_parallel_size=8, pipeline_parallel_size=2),
        cpus_per_engine=2,
        gpus_per_engine=16,
        resources={},
    )
    assert gpu_pp is not None and gpu_pp.strategy == "PACK" and len(gpu_pp.bundles) == 16

    cpu = engine_group(
        Topology(pipeline_parallel_size=2),
        cpus_per_engine=4,
        gpus_per_engine=0,
        resources={"accelerator:cpu": 1},
    )
    assert cpu is not None and cpu.executor == "mp" and cpu.strategy == "STRICT_PACK"
    assert cpu.bundles == ({"CPU": 2.0, "accelerator:cpu": 0.5}, {"CPU": 2.0, "accelerator:cpu": 0.5})
    assert engine_group(Topology(), cpus_per_engine=1, gpus_per_engine=1, resources={}) is None


def node(name: str, **resources: float) -> Node:
    return Node(resources.get("CPU", 0), 1 << 34, dict(resources), name)


def test_a_group_that_no_node_can_hold_is_refused_naming_the_nodes():
    cpu_tp2 = engine_group(
        Topology(tensor_parallel_size=2), cpus_per_engine=2, gpus_per_engine=0, resources={}
    )
    assert cpu_tp2 is not None
    assert group_problem(cpu_tp2, [node("aaaaaaaa11", CPU=2)]) is None
    problem = group_problem(cpu_tp2, [node("aaaaaaaa11", CPU=1), node("bbbbbbbb22", CPU=1)])
    assert problem == (
        "an engine needs CPU 2 on one node (2 ranks packed together); nodes: aaaaaaaa: CPU 1; bbbbbbbb: CPU 1"
    )
    gpu_pp = engine_group(
        Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
        cpus_per_engine=1,
        gpus_per_engine=4,
        resources={},
    )
    assert gpu_pp is not None
    two_pods = [node("pod-a", CPU=8, GPU=2), node("pod-b", CPU=8, GPU=2)]
    assert group_problem(gpu_pp, two_pods) is None  # stages may span the pods
    assert "the nodes together offer less" in (group_problem(gpu_pp, two_pods[:1]) or "")


def test_cpu_placement_counts_cores_in_whole_ranks():
    nodes = [Node(2, 1 << 40), Node(4, 1 << 40)]
    assert engines_per_core(nodes, 1 << 30) == 6
    assert engines_per_core(nodes, 1 << 30, ranks=2) == 3
    assert cpus_per_engine(1, [2.0], ranks=2) == 2.0
    assert cpus_per_engine(2, [4.0, 4.0], ranks=2) == 4.0  # one engine per node: two cores per rank
    assert cpus_per_engine(1, [], ranks=2) == 2.0


def test_each_rank_binds_its_own_run_of_cores():
    assert omp_bind([0, 1], 1) == "0,1"
    assert omp_bind([0, 1], 2) == "0|1"
    assert omp_bind([4, 5, 6, 7], 2) == "4,5|6,7"
    with pytest.raises(ValueError, match="3 cores cannot be shared out over 2 ranks"):
        omp_bind([0, 1, 2], 2)
