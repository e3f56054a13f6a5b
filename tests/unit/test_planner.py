"""The KV budget planner: model shapes from config.json, the bytes-per-token formula, capacity, fitting, units."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline.max_tokens import output_budget
from pipeline.model_shape import PlanError, model_shape, shape_from_config, weights_bytes
from pipeline.planner import (
    DeviceBudget,
    activation_reserve,
    fit_context,
    kv_bytes_per_token,
    length_histogram,
    plan_pool,
)
from pipeline.units import GiB, parse_memory
from tests.unit.planner_models import (
    DEEPSEEK_V3,
    LLAMA3_8B,
    MISTRAL_7B_V01,
    QWEN3_06B,
    SMOLLM2,
    make_model,
    plan_app,
    write_safetensors,
)

# --- shapes and bytes per token ---------------------------------------------------------------------------------


def test_embedded_model_bytes_per_token_is_the_config_formula():
    shape = shape_from_config(SMOLLM2)
    expected = (
        2
        * SMOLLM2["num_hidden_layers"]
        * SMOLLM2["num_key_value_heads"]
        * SMOLLM2["head_dim"]
        * 2  # bfloat16
    )
    assert kv_bytes_per_token(shape) == expected == 23_040


def test_embedded_model_cpu_capacity_matches_the_measured_engine():
    # The engine logs 364 blocks of 128 tokens (46,592 tokens) at VLLM_CPU_KVCACHE_SPACE=1.
    plan = plan_pool(shape_from_config(SMOLLM2), DeviceBudget.cpu(1), context=2048)
    assert (plan.block_size, plan.kv_blocks, plan.kv_capacity_tokens) == (128, 364, 46_592)
    assert plan.max_concurrent_seqs == 22 and plan.recommended_max_num_seqs == 22


def test_llama_gqa_uses_kv_heads_and_derived_head_dim():
    shape = shape_from_config(LLAMA3_8B)
    assert (shape.kv_heads, shape.head_dim, shape.max_model_len_limit) == (8, 128, 8192)
    assert kv_bytes_per_token(shape) == 2 * 32 * 8 * 128 * 2 == 128 * 1024


def test_explicit_head_dim_wins_over_hidden_over_heads():
    shape = shape_from_config(QWEN3_06B)
    assert shape.head_dim == 128
    assert kv_bytes_per_token(shape) == 2 * 28 * 8 * 128 * 2
    assert shape.sliding_window is None  # shipped but switched off by use_sliding_window


def test_no_kv_heads_means_multi_head_and_multi_query_means_one():
    mha = shape_from_config({**LLAMA3_8B, "num_key_value_heads": None})
    assert mha.kv_heads == 32
    falcon = {"model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71, "num_hidden_layers": 32}
    assert shape_from_config({**falcon, "multi_query": True}).kv_heads == 1


def test_fp8_kv_cache_halves_bytes_per_token():
    shape = shape_from_config(LLAMA3_8B)
    assert kv_bytes_per_token(shape, "fp8") * 2 == kv_bytes_per_token(shape, "auto")
    assert kv_bytes_per_token(shape, "fp8_e5m2") == 2 * 32 * 8 * 128


def test_unknown_kv_cache_dtype_is_refused_with_the_choices():
    with pytest.raises(PlanError, match="fp8"):
        kv_bytes_per_token(shape_from_config(LLAMA3_8B), "int3")


def test_float32_checkpoint_is_planned_at_16_bits_as_vllm_serves_it():
    shape = shape_from_config({**LLAMA3_8B, "torch_dtype": "float32"})
    assert shape.dtype_bytes == 2
    assert any("float32" in note for note in shape.notes)


def test_deepseek_mla_caches_one_latent_per_layer():
    shape = shape_from_config(DEEPSEEK_V3)
    assert shape.is_mla and shape.kv_heads == 1 and shape.head_dim == 512 + 64
    assert kv_bytes_per_token(shape) == 61 * (512 + 64) * 2  # ~70 KB, not 2 × 128 heads × 192
    assert shape.max_model_len_limit == 163_840  # YaRN: the config's length is already the scaled one
    plan = plan_pool(shape, DeviceBudget.cpu(1), context=4096)
    assert plan.block_size == 16  # vLLM's CPU MLA kernel
    assert any("MLA" in note for note in plan.notes)


def test_sparse_mla_is_refused_clearly():
    with pytest.raises(PlanError, match="indexer"):
        shape_from_config({**DEEPSEEK_V3, "model_type": "deepseek_v32", "index_topk": 2048})


def test_hybrid_recurrent_models_are_refused_clearly():
    config = {**LLAMA3_8B, "layer_types": ["full_attention", "linear_attention"] * 16}
    with pytest.raises(PlanError, match="linear_attention"):
        shape_from_config(config)
    with pytest.raises(PlanError, match="attention-only"):
        shape_from_config({**LLAMA3_8B, "model_type": "jamba"})


def test_multimodal_config_is_planned_from_its_text_model():
    outer = {"model_type": "llava", "vision_config": {"hidden_size": 1024}, "text_config": LLAMA3_8B}
    assert kv_bytes_per_token(shape_from_config(outer)) == kv_bytes_per_token(shape_from_config(LLAMA3_8B))


def test_linear_rope_scaling_extends_the_limit_as_vllm_does():
    scaled = {**LLAMA3_8B, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert shape_from_config(scaled).max_model_len_limit == 4 * 8192
    llama3 = {**LLAMA3_8B, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert shape_from_config(llama3).max_model_len_limit == 8192


def test_tokenizer_limit_caps_the_context(tmp_path):
    directory = make_model(tmp_path, LLAMA3_8B)
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    assert model_shape(directory).max_model_len_limit == 4096


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(PlanError, match="config.json"):
        model_shape(tmp_path)


# --- sliding window ---------------------------------------------------------------------------------------------


def test_mistral_sliding_window_fits_more_sequences_than_full_attention():
    window = shape_from_config(MISTRAL_7B_V01)
    full = shape_from_config({**MISTRAL_7B_V01, "sliding_window": None})
    assert (window.sliding_window, window.sliding_window_layers) == (4096, 32)
    budget = DeviceBudget.gpu(80 * GiB, activation_reserve_bytes=GiB).model_copy()
    window_plan = plan_pool(window.model_copy(update={"weights_bytes": 14 * GiB}), budget, context=32768)
    full_plan = plan_pool(full.model_copy(update={"weights_bytes": 14 * GiB}), budget, context=32768)
    # Same cache, same tokens; but a sequence holds only its 4k window in each layer.
    assert window_plan.kv_capacity_tokens == full_plan.kv_capacity_tokens
    assert window_plan.max_concurrent_seqs >= 7 * full_plan.max_concurrent_seqs
    assert any("sliding" in note and "assumes" in note for note in window_plan.notes)


def test_interleaved_sliding_layers_are_counted():
    gemma2 = {
        "model_type": "gemma2",
        "head_dim": 256,
        "hidden_size": 2304,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_hidden_layers": 26,
        "sliding_window": 4096,
        "max_position_embeddings": 8192,
    }
    assert shape_from_config(gemma2).sliding_window_layers == 13
    typed = {**gemma2, "layer_types": ["sliding_attention", "full_attention"] * 13}
    assert shape_from_config(typed).sliding_window_layers == 13
    gemma3 = {**gemma2, "model_type": "gemma3_text", "num_hidden_layers": 24, "sliding_window_pattern": 6}
    assert shape_from_config(gemma3).sliding_window_layers == 20


# --- weights ----------------------------------------------------------------------------------------------------


def test_weights_come_from_safetensors_headers(tmp_path):
    directory = make_model(tmp_path, LLAMA3_8B, {"a": 1000, "b": 24})
    assert weights_bytes(directory) == 1024
    assert model_shape(directory).weights_bytes == 1024


def test_sharded_weights_follow_the_index_and_skip_duplicate_consolidated(tmp_path):
    directory = make_model(tmp_path, LLAMA3_8B)
    write_safetensors(directory / "model-00001-of-00002.safetensors", {"a": 100})
    write_safetensors(directory / "model-00002-of-00002.safetensors", {"b": 200})
    write_safetensors(directory / "consolidated.safetensors", {"a": 100, "b": 200})
    assert weights_bytes(directory) == 300
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weights_bytes(directory) == 300


def test_no_weight_files_means_unknown_weights(tmp_path):
    assert weights_bytes(make_model(tmp_path, LLAMA3_8B)) is None


# --- budgets and recommendations --------------------------------------------------------------------------------


def test_gpu_budget_is_memory_times_utilization_minus_weights_and_reserve():
    shape = shape_from_config(LLAMA3_8B).model_copy(update={"weights_bytes": 16 * GiB})
    budget = DeviceBudget.gpu(80 * GiB, 0.9)
    reserve = activation_reserve(budget)
    assert reserve == max(GiB, int(80 * GiB * 0.9) // 20)
    plan = plan_pool(shape, budget)
    assert plan.kv_budget_bytes == int(80 * GiB * 0.9) - 16 * GiB - reserve
    assert plan.block_size == 16
    assert plan.kv_blocks == plan.kv_budget_bytes // (16 * 128 * 1024)
    assert plan.max_concurrent_seqs == plan.kv_capacity_tokens // 8192
    assert plan.recommended_max_model_len == 8192
    assert any("activation reserve" in note for note in plan.notes)


def test_gpu_plan_needs_weights(tmp_path):
    with pytest.raises(PlanError, match="weight files"):
        plan_pool(shape_from_config(LLAMA3_8B), DeviceBudget.gpu(80 * GiB))


def test_weights_larger_than_the_gpu_leave_no_cache():
    shape = shape_from_config(LLAMA3_8B).model_copy(update={"weights_bytes": 140 * GiB})
    plan = plan_pool(shape, DeviceBudget.gpu(80 * GiB))
    assert plan.kv_capacity_tokens == 0 and plan.max_concurrent_seqs == 0
    assert plan.recommended_max_model_len is None and plan.recommended_max_num_seqs is None
    assert any("no room for a KV cache" in w for w in plan.warnings)


def test_context_that_fits_no_sequence_is_named_and_a_fitting_one_recommended():
    shape = shape_from_config(LLAMA3_8B)
    plan = plan_pool(shape, DeviceBudget.cpu(1), context=8192)  # 1 GiB = 8,192 tokens at 128 KiB/token
    assert plan.kv_capacity_tokens == 8192 and plan.max_concurrent_seqs == 1
    tight = plan_pool(shape.model_copy(update={"max_model_len_limit": 32768}), DeviceBudget.cpu(1), 16384)
    assert tight.max_concurrent_seqs == 0
    assert tight.recommended_max_model_len == 8192 and tight.recommended_max_num_seqs == 1
    assert any("does not fit even one sequence" in w for w in tight.warnings)


def test_context_above_the_model_limit_is_warned_and_capped():
    plan = plan_pool(shape_from_config(SMOLLM2), DeviceBudget.cpu(2), context=16384)
    assert plan.recommended_max_model_len == 8192
    assert any("exceeds the model's limit" in w for w in plan.warnings)


def test_max_num_seqs_is_capped_at_256():
    plan = plan_pool(shape_from_config(SMOLLM2), DeviceBudget.cpu(2), context=128)
    assert plan.max_concurrent_seqs == 728 and plan.recommended_max_num_seqs == 256
    assert any("capped at 256" in note for note in plan.notes)


def test_cpu_cache_larger_than_host_memory_is_warned():
    plan = plan_pool(shape_from_config(SMOLLM2), DeviceBudget.cpu(64, host_memory_bytes=16 * GiB), 2048)
    assert any("exceed host memory" in w for w in plan.warnings)


# --- fitting the context ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("needs", "block", "limit", "context"),
    [
        ([100, 129], 128, 8192, 256),
        ([128], 128, 8192, 128),
        ([1], 16, 8192, 16),
        ([4000, 9000], 128, 8192, 8192),  # capped at the model's limit
        ([300], 128, 200, 200),
    ],
)
def test_fit_context_rounds_up_to_whole_blocks(needs, block, limit, context):
    fit = fit_context(needs, block, limit)
    assert fit.context == context and fit.longest == max(needs)


def test_fit_context_counts_requests_over_the_limit():
    fit = fit_context([10, 9000, 9001], 128, 8192)
    assert fit.over_limit == 2 and fit.requests == 3
    with pytest.raises(PlanError):
        fit_context([], 128, 8192)


def test_output_budget_follows_vllm_defaults():
    assert output_budget("/v1/chat/completions", {"max_tokens": 64}) == (64, False)
    assert output_budget("/v1/chat/completions", {"max_tokens": 64, "max_completion_tokens": 9}) == (9, False)
    assert output_budget("/v1/completions", {}) == (16, False)
    assert output_budget("/v1/chat/completions", {}, generation_default=512) == (512, False)
    assert output_budget("/v1/chat/completions", {}, chat_default=100) == (100, True)


def test_histogram_buckets_are_powers_of_two():
    buckets = length_histogram([3, 40, 41, 500])
    assert [(b.low, b.high, b.count) for b in buckets] == [
        (0, 31, 1),
        (32, 63, 2),
        (64, 127, 0),
        (128, 255, 0),
        (256, 511, 1),
    ]
    assert length_histogram([]) == []


# --- units ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("80GiB", 80 * 2**30),
        ("80 gib", 80 * 2**30),
        ("80Gi", 80 * 2**30),
        ("24GB", 24 * 10**9),
        ("81559MiB", 81559 * 2**20),
        ("1.5TiB", int(1.5 * 2**40)),
        ("12345", 12345),
        (4096, 4096),
    ],
)
def test_parse_memory(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("text", ["eighty", "80XB", "-1GiB", "0", "", "GiB", "1e9"])
def test_parse_memory_rejects_nonsense(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_memory(text)


# --- the command, on a synthetic model (no tokenizer needed) ------------------------------------------------------


def test_cli_json_plan_for_a_gpu(tmp_path):
    model = make_model(tmp_path, LLAMA3_8B, {"w": 16 * 2**20})
    result = CliRunner().invoke(
        plan_app(), ["plan", "--model", str(model), "--gpu-memory", "24GiB", "--json"]
    )
    assert result.exit_code == 0, result.output
    pool = json.loads(result.output)["pools"][0]
    assert pool["pool"] == "gpu" and pool["kv_bytes_per_token"] == 131072 and pool["block_size"] == 16
    assert pool["context"] == 8192 and pool["context_source"] == "model limit"


def test_cli_table_for_cpu_names_the_budget(tmp_path):
    model = make_model(tmp_path, LLAMA3_8B, {"w": 1024})
    result = CliRunner().invoke(
        plan_app(), ["plan", "--model", str(model), "--cpu-kvcache-space", "4", "--max-model-len", "4096"]
    )
    assert result.exit_code == 0, result.output
    assert "pool cpu" in result.output and "VLLM_CPU_KVCACHE_SPACE=4" in result.output
    assert "32,768" in result.output  # 4 GiB / 128 KiB per token
    assert "--max-model-len" in result.output


def test_cli_bad_gpu_memory_is_a_bad_parameter(tmp_path):
    model = make_model(tmp_path, LLAMA3_8B, {"w": 1024})
    result = CliRunner().invoke(plan_app(), ["plan", "--model", str(model), "--gpu-memory", "lots"])
    assert result.exit_code == 2
    assert "--gpu-memory" in result.output and "80GiB" in result.output


def test_cli_unplannable_model_fails_with_the_reason(tmp_path):
    model = make_model(tmp_path, {**DEEPSEEK_V3, "index_topk": 2048}, {"w": 1024})
    result = CliRunner().invoke(plan_app(), ["plan", "--model", str(model)])
    assert result.exit_code == 2 and "indexer" in result.output
