"""The KV planner for sharded engines (tensor × pipeline parallel): per-device weights and KV, vLLM's layer split
and KV-head replication, the smallest engine that holds a model too big for one GPU, and `nightshift plan`'s view.

Every expected number is worked out here from the model's shape and vLLM's rules, not read back from the planner.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.model_shape import PlanError, model_shape, shape_from_config
from pipeline.planner import SHARDING_FIELDS, DeviceBudget, plan_pool
from pipeline.topology import Topology, kv_heads_per_rank, stage_layers
from pipeline.units import GiB, fmt_bytes
from tests.unit.planner_models import (
    BF16,
    DEEPSEEK_V3,
    LLAMA3_70B,
    SMOLLM2,
    llama_tensors,
    make_model,
    plan_app,
    write_header_only,
)

# The embedded model's full config (its MLP width decides which tensor_parallel_size it takes).
SMOLLM2_FULL = {**SMOLLM2, "intermediate_size": 1536}

USABLE_80GIB = int(80 * GiB * 0.9)
RESERVE_80GIB = max(GiB, USABLE_80GIB // 20)  # the planner's stated assumption: max(1 GiB, 5% of usable)
GPU_BLOCK = 16  # vLLM's CUDA default
CPU_BLOCK = 128  # vLLM's CPU default


@pytest.fixture
def llama70b(tmp_path) -> Path:
    directory = make_model(tmp_path, LLAMA3_70B, name="llama-3-70b")
    write_header_only(directory / "model.safetensors", llama_tensors(LLAMA3_70B))
    return directory


def test_the_synthetic_70b_checkpoint_weighs_141_gb(llama70b):
    weights = model_shape(llama70b).weights_bytes
    assert weights == sum(llama_tensors(LLAMA3_70B).values())
    assert 140e9 < weights < 142e9  # 70.6B parameters × 2 bytes


def rank_bytes_per_token(layers: int, kv_heads: int, head_dim: int = 128) -> int:
    return 2 * layers * kv_heads * head_dim * BF16


def gpu_blocks(weights: int, tp: int, pp: int, layers: int, kv_heads: int) -> int:
    """Blocks one rank holds: 80 GiB × 0.9 − its share of the weights − the reserve, over its bytes per block."""
    left = USABLE_80GIB - -(-weights // (tp * pp)) - RESERVE_80GIB
    return max(0, left) // (GPU_BLOCK * rank_bytes_per_token(layers, kv_heads))


# --- the 70B model on 80 GiB GPUs ------------------------------------------------------------------------------


def test_70b_does_not_fit_one_gpu_and_the_plan_names_the_smallest_tensor_parallel_size(llama70b):
    shape = model_shape(llama70b)
    weights = shape.weights_bytes
    plan = plan_pool(shape, DeviceBudget.gpu(80 * GiB, 0.9))
    assert weights + RESERVE_80GIB > USABLE_80GIB
    assert plan.kv_capacity_tokens == 0 and plan.recommended_max_model_len is None
    # The smallest size the model takes (heads 64, KV heads 8, MLP 28672 all divide) that leaves one rank room
    # for one 8,192-token sequence: 8,192 / 16 blocks of its own layers and KV heads.
    takes = [tp for tp in range(1, 9) if 64 % tp == 0 and 8 % tp == 0 and 28672 % tp == 0]
    expected = next(tp for tp in takes if gpu_blocks(weights, tp, 1, 80, 8 // tp) >= 8192 // GPU_BLOCK)
    assert expected > 1
    assert (plan.suggested_tensor_parallel_size, plan.suggested_pipeline_parallel_size) == (expected, 1)
    advice = next(w for w in plan.warnings if "smallest tensor_parallel_size" in w)
    assert f"{weights / 1e9:.3g} GB" in advice and "one 80 GiB device at 0.9 utilization" in advice
    assert f"is {expected} ({fmt_bytes(-(-weights // expected))} of weights per device" in advice
    tokens = gpu_blocks(weights, expected, 1, 80, 8 // expected) * GPU_BLOCK
    assert f"a KV cache of {tokens:,} tokens" in advice


def test_70b_at_tensor_parallel_4_is_planned_per_device(llama70b):
    shape = model_shape(llama70b)
    weights = shape.weights_bytes
    plan = plan_pool(shape, DeviceBudget.gpu(80 * GiB, 0.9), topology=Topology(tensor_parallel_size=4))
    per_device = -(-weights // 4)
    budget = USABLE_80GIB - per_device - RESERVE_80GIB
    per_token = rank_bytes_per_token(80, 8 // 4)
    assert per_token == 81_920
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (4, 1)
    assert plan.weights_bytes == weights and plan.weights_per_device_bytes == per_device
    assert plan.kv_budget_bytes == budget
    assert plan.kv_bytes_per_token == rank_bytes_per_token(80, 8)  # the whole model's, for reference
    [stage] = plan.stages
    assert (stage.ranks, stage.layers, stage.kv_heads) == ([0, 1, 2, 3], 80, 2)
    assert (stage.weights_bytes, stage.kv_budget_bytes, stage.kv_bytes_per_token) == (
        per_device,
        budget,
        per_token,
    )
    assert plan.kv_blocks == stage.kv_blocks == budget // (GPU_BLOCK * per_token)
    assert plan.kv_capacity_tokens == plan.kv_blocks * GPU_BLOCK
    assert plan.max_concurrent_seqs == plan.kv_blocks // (8192 // GPU_BLOCK)
    assert plan.suggested_tensor_parallel_size is None
    assert not any("no room" in w for w in plan.warnings)
    assert any("KV budget per device" in note and "/ 4 ranks" in note for note in plan.notes)


def test_more_tensor_ranks_than_kv_heads_replicate_the_heads(llama70b):
    shape = model_shape(llama70b)
    plan = plan_pool(shape, DeviceBudget.gpu(80 * GiB, 0.9), topology=Topology(tensor_parallel_size=16))
    [stage] = plan.stages
    assert stage.kv_heads == 1  # 8 // 16 is 0: vLLM keeps one per rank, each head on 16 / 8 = 2 ranks
    assert stage.kv_bytes_per_token == rank_bytes_per_token(80, 1)
    assert plan.kv_blocks == gpu_blocks(shape.weights_bytes, 16, 1, 80, 1)
    assert any("replicated on 2 ranks" in note for note in plan.notes)
    assert kv_heads_per_rank(shape, 8) == 1 and kv_heads_per_rank(shape, 64) == 1


def test_pipeline_stages_hold_their_layers_and_the_engine_the_tightest_stage(llama70b):
    shape = model_shape(llama70b)
    plan = plan_pool(
        shape,
        DeviceBudget.gpu(80 * GiB, 0.9),
        topology=Topology(tensor_parallel_size=2, pipeline_parallel_size=3),
    )
    # 80 = 3 × 26 + 2: the two extra layers go to the stages before the last, from the second-to-last back.
    assert [stage.layers for stage in plan.stages] == [27, 27, 26]
    assert [stage.ranks for stage in plan.stages] == [[0, 1], [2, 3], [4, 5]]
    expected = [gpu_blocks(shape.weights_bytes, 2, 3, layers, 4) for layers in (27, 27, 26)]
    assert [stage.kv_blocks for stage in plan.stages] == expected
    assert plan.kv_blocks == min(expected) == expected[0]


@pytest.mark.parametrize(
    ("layers", "stages", "split"),
    [
        (30, 4, [7, 8, 8, 7]),  # remainder 2: the middle stages take one more each
        (80, 3, [27, 27, 26]),
        (7, 4, [2, 2, 2, 1]),  # remainder 3: every stage but the last
        (32, 4, [8, 8, 8, 8]),
        (5, 1, [5]),
        (4, 4, [1, 1, 1, 1]),
    ],
)
def test_layers_split_over_stages_as_vllm_splits_them(layers, stages, split):
    assert stage_layers(layers, stages) == split
    assert sum(split) == layers


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="4 layers into 5 stages"):
        stage_layers(4, 5)
    with pytest.raises(PlanError, match="at most 30"):
        plan_pool(
            shape_from_config(SMOLLM2_FULL), DeviceBudget.cpu(2), topology=Topology(pipeline_parallel_size=31)
        )


def test_a_suggestion_past_one_node_is_the_fewest_devices_that_fit(llama70b):
    shape = model_shape(llama70b)
    budget = DeviceBudget.gpu(24 * GiB, 0.9, devices_per_node=4)
    plan = plan_pool(shape, budget, context=4096)
    tp, pp = plan.suggested_tensor_parallel_size, plan.suggested_pipeline_parallel_size
    assert tp <= 4 and pp > 1  # 131 GiB on four 24 GiB devices leaves no room: more stages are needed
    advice = next(w for w in plan.warnings if "pipeline_parallel_size" in w)
    assert "within one node of 4 devices" in advice and f"({tp * pp} devices" in advice

    def fits(t: int, p: int) -> bool:
        topology = Topology(tensor_parallel_size=t, pipeline_parallel_size=p)
        return plan_pool(shape, budget, 4096, topology=topology).max_concurrent_seqs >= 1

    assert fits(tp, pp)
    assert not any(fits(t, p) for t in (1, 2, 4) for p in range(1, 81) if t * p < tp * pp)


def test_no_suggestion_when_even_a_large_engine_does_not_fit(llama70b):
    shape = model_shape(llama70b)
    plan = plan_pool(shape, DeviceBudget.gpu(2 * GiB, 0.9, devices_per_node=1), context=8192)
    assert plan.suggested_tensor_parallel_size is None
    assert any("no engine of up to 64 devices" in w and "quantized" in w for w in plan.warnings)


def test_mla_keeps_its_whole_latent_on_every_tensor_rank():
    shape = shape_from_config(DEEPSEEK_V3).model_copy(update={"weights_bytes": 8 * GiB})
    plan = plan_pool(shape, DeviceBudget.gpu(80 * GiB), topology=Topology(tensor_parallel_size=8))
    assert plan.stages[0].kv_heads == 1
    assert plan.stages[0].kv_bytes_per_token == 61 * (512 + 64) * 2 == plan.kv_bytes_per_token


# --- the embedded model on CPU ---------------------------------------------------------------------------------


def test_embedded_model_on_cpu_at_tensor_parallel_3_holds_three_times_the_tokens():
    shape = shape_from_config(SMOLLM2_FULL)
    # 9 heads, 3 KV heads, MLP 1536: 3 is the only size above 1 all of them allow (9 does not divide 1536).
    assert [tp for tp in range(2, 10) if 9 % tp == 0 and (3 % tp == 0 or tp % 3 == 0) and 1536 % tp == 0] == [
        3
    ]
    single = plan_pool(shape, DeviceBudget.cpu(2), context=2048)
    plan = plan_pool(shape, DeviceBudget.cpu(2), context=2048, topology=Topology(tensor_parallel_size=3))
    per_token = 2 * 30 * (3 // 3) * 64 * BF16  # every rank: all 30 layers, one of the 3 KV heads
    assert per_token == 7_680
    blocks = 2 * GiB // (CPU_BLOCK * per_token)  # each rank has its own VLLM_CPU_KVCACHE_SPACE
    assert plan.kv_budget_bytes == 2 * GiB
    assert plan.stages[0].kv_bytes_per_token == per_token
    assert (plan.kv_blocks, plan.kv_capacity_tokens) == (blocks, blocks * CPU_BLOCK) == (2184, 279_552)
    assert plan.kv_capacity_tokens == 3 * single.kv_capacity_tokens  # 3 ranks × 2 GiB, a third of the KV each
    assert plan.max_concurrent_seqs == blocks // (2048 // CPU_BLOCK)
    assert any("each of the engine's 3 ranks allocates its own, 6 GiB in all" in note for note in plan.notes)


def test_embedded_model_pipeline_stages_on_cpu():
    shape = shape_from_config(SMOLLM2_FULL)
    plan = plan_pool(shape, DeviceBudget.cpu(1), topology=Topology(pipeline_parallel_size=4))
    assert [stage.layers for stage in plan.stages] == [7, 8, 8, 7]
    assert plan.kv_blocks == GiB // (CPU_BLOCK * 2 * 8 * 3 * 64 * BF16)  # the 8-layer stages are the tightest


def test_cpu_ranks_each_take_the_kv_space_from_host_memory():
    shape = shape_from_config(SMOLLM2_FULL)
    host = 8 * GiB
    assert not plan_pool(shape, DeviceBudget.cpu(3, host), 2048).warnings
    sharded = plan_pool(shape, DeviceBudget.cpu(3, host), 2048, topology=Topology(tensor_parallel_size=3))
    assert any("3 ranks × 3 GiB" in w and "exceed host memory" in w for w in sharded.warnings)


def test_a_tensor_parallel_size_the_model_does_not_take_is_refused_with_the_ones_it_does():
    with pytest.raises(PlanError, match="takes tensor_parallel_size 1, 3"):
        plan_pool(
            shape_from_config(SMOLLM2_FULL), DeviceBudget.cpu(2), topology=Topology(tensor_parallel_size=2)
        )


def test_topology_of_engine_args_plans_like_an_explicit_one():
    shape = shape_from_config(SMOLLM2_FULL)
    args = {"tensor_parallel_size": 3, "pipeline_parallel_size": None, "cpu_kvcache_space_gib": 2}
    assert plan_pool(shape, DeviceBudget.cpu(2), topology=Topology.of(args)) == plan_pool(
        shape, DeviceBudget.cpu(2), topology=Topology(tensor_parallel_size=3)
    )


def test_one_device_plans_leave_the_sharding_fields_unset():
    plan = plan_pool(shape_from_config(SMOLLM2_FULL), DeviceBudget.cpu(2))
    assert not plan.sharded and plan.stages == [] and plan.weights_per_device_bytes is None
    assert plan == plan_pool(shape_from_config(SMOLLM2_FULL), DeviceBudget.cpu(2), topology=Topology())


# --- the command -----------------------------------------------------------------------------------------------


def test_cli_shows_the_topology_and_each_stage(llama70b):
    result = CliRunner().invoke(
        plan_app(),
        [
            "plan",
            "--model",
            str(llama70b),
            "--gpu-memory",
            "80GiB",
            "--tensor-parallel-size",
            "2",
            "--pipeline-parallel-size",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "TP=2 PP=2" in result.output and "4 ranks per engine, one GPU each" in result.output
    assert "weights / rank" in result.output and "KV budget / rank" in result.output
    assert "per rank" in result.output and "0–1" in result.output and "2–3" in result.output


def test_cli_json_tells_a_model_too_big_for_one_gpu_what_fits(llama70b):
    result = CliRunner().invoke(
        plan_app(), ["plan", "--model", str(llama70b), "--gpu-memory", "80GiB", "--json"]
    )
    assert result.exit_code == 0, result.output
    pool = json.loads(result.output)["pools"][0]
    assert pool["kv_capacity_tokens"] == 0 and pool["suggested_tensor_parallel_size"] > 1
    assert pool["suggested_pipeline_parallel_size"] == 1
    assert "stages" not in pool and "tensor_parallel_size" not in pool  # the plan itself is one device


def test_cli_json_of_a_one_device_plan_has_no_sharding_fields(tmp_path):
    model = make_model(tmp_path, SMOLLM2_FULL)
    result = CliRunner().invoke(plan_app(), ["plan", "--model", str(model), "--json"])
    assert result.exit_code == 0, result.output
    pool = json.loads(result.output)["pools"][0]
    assert not set(SHARDING_FIELDS) & set(pool) and "devices_per_node" not in pool["budget"]


def test_cli_refuses_a_topology_the_model_does_not_take_naming_it(tmp_path):
    model = make_model(tmp_path, SMOLLM2_FULL, name="smol")
    result = CliRunner().invoke(plan_app(), ["plan", "--model", str(model), "--tensor-parallel-size", "2"])
    assert result.exit_code == 2
    assert "smol" in result.output and "tensor_parallel_size 1, 3" in result.output
