"""LoRA adapters without Ray or vLLM: the flag, the names a job serves, the checks before work, routing keys,
per-name counts and the fake engine's adapter slots."""

from __future__ import annotations

import asyncio
import json

import pyarrow as pa
import pytest

from pipeline.adapters import (
    AdapterError,
    check_adapter_config,
    parse_lora_modules,
    served_names,
)
from pipeline.config import ConfigError, JobConfig, PoolConfig, lora_modules_flag
from pipeline.engines.base import EngineRequest, EngineSpec
from pipeline.engines.fake import FakeEngine
from pipeline.io.adapter_files import local_adapter_dir, read_adapter_config
from pipeline.job_plan import JobPlan, JobPlanError
from pipeline.models import ResolvedModel
from pipeline.observe.usage import merge_rows_by_model, rows_by_model
from pipeline.stages.prefix_key import prefix_key, routing_key
from pipeline.stages.validate import LineValidator, ValidRequest


def test_the_flag_takes_name_equals_path_and_vllms_json_form():
    got = parse_lora_modules(
        ["sql=/models/sql", '{"name": "poet", "path": "s3://b/poet", "base_model_name": "x"}']
    )
    assert got == {"sql": "/models/sql", "poet": "s3://b/poet"}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("sql", "must be NAME=PATH"),
        ("=path", "must be NAME=PATH"),
        ("sql=", "must be NAME=PATH"),
        ('{"name": "x"}', '"name" and "path"'),
        ("{nope", "not valid JSON"),
        ("a b=/x", "adapter name 'a b'"),
    ],
)
def test_a_bad_flag_value_says_what_to_give(value, says):
    with pytest.raises(ConfigError, match=says):
        lora_modules_flag([value], "--lora-modules")


def test_one_name_given_twice_with_two_paths_is_refused():
    with pytest.raises(AdapterError, match="given twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    assert parse_lora_modules(["a=/x", "a=/x"]) == {"a": "/x"}


def test_served_names_map_each_adapter_to_its_model_and_task():
    served = served_names(
        {"base": "generate", "emb": "embed"}, [("p1", "base", {"sql": "/s"}), ("p2", "emb", {})]
    )
    assert served.adapters == {"sql": "base"}
    assert served.validation_map() == {"base": "generate", "emb": "embed", "sql": "generate"}
    assert served.names_of("base") == ["base", "sql"] and served.names_of("emb") == ["emb"]


@pytest.mark.parametrize(
    ("pools", "says"),
    [
        ([("p1", "base", {"base": "/s"})], "has the name of a served model"),
        ([("p1", "base", {"a": "/s"}), ("p2", "other", {"a": "/s"})], "one name must mean one adapter"),
        ([("p1", "base", {"a": "/s"}), ("p2", "base", {"a": "/t"})], "has two paths"),
    ],
)
def test_names_that_would_be_ambiguous_are_refused(pools, says):
    with pytest.raises(AdapterError, match=says):
        served_names({"base": "generate", "other": "generate"}, pools)


def test_the_same_adapter_on_two_pools_of_one_model_is_one_name():
    served = served_names({"base": "generate"}, [("p1", "base", {"a": "/s"}), ("p2", "base", {"a": "/s"})])
    assert served.adapters == {"a": "base"}


def _model(name: str, task: str | None = "generate") -> ResolvedModel:
    return ResolvedModel(name=name, path=f"/m/{name}", revision="r", source="local-dir", task=task)


def test_a_pools_own_adapters_override_the_jobs():
    config = JobConfig.model_validate(
        {
            "engine": {"vllm": {"lora_modules": {"a": "/a"}}},
            "pools": [
                {"name": "one"},
                {"name": "two", "model": "/m/other", "engine_overrides": {"lora_modules": {"b": "/b"}}},
            ],
        }
    )
    one, two = JobPlan.of(config).pools
    assert one.adapters == {"a": "/a"} and two.adapters == {"b": "/b"}
    served = JobPlan.of(config, {"one": _model("base"), "two": _model("other")}).served
    assert served.adapters == {"a": "base", "b": "other"}


def test_adapters_of_a_pooling_model_are_refused():
    config = JobConfig.model_validate({"engine": {"vllm": {"lora_modules": {"a": "/a"}}}})
    pool = PoolConfig(name="default")
    with pytest.raises(JobPlanError, match="generating models only"):
        JobPlan.of(config.model_copy(update={"pools": [pool]}), {"default": _model("emb", "embed")})


def test_a_line_naming_an_adapter_is_valid_and_one_naming_nothing_lists_what_is_served():
    served = served_names({"base": "generate"}, [("p", "base", {"sql": "/s"})]).validation_map()
    validator = LineValidator(served)

    def check(model: str):
        line = {"custom_id": model, "method": "POST", "url": "/v1/chat/completions"}
        line["body"] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        return validator.check(json.dumps(line).encode(), 1, "in.jsonl")[0]

    assert isinstance(check("sql"), ValidRequest) and isinstance(check("base"), ValidRequest)
    wrong = check("poet")
    assert wrong.code == "model_not_found"
    assert "'base'" in wrong.record["error"]["message"] and "'sql'" in wrong.record["error"]["message"]


def test_adapter_config_checks_say_what_to_change():
    assert check_adapter_config({"peft_type": "LORA", "r": 8}, "a", None) == 8
    with pytest.raises(AdapterError, match="--max-lora-rank 32"):
        check_adapter_config({"peft_type": "LORA", "r": 32}, "a", None)
    with pytest.raises(AdapterError, match="--max-lora-rank 32"):
        check_adapter_config({"peft_type": "LORA", "r": 24}, "a", 16)  # 24 is no rank vLLM takes
    assert check_adapter_config({"peft_type": "LORA", "r": 32}, "a", 32) == 32
    with pytest.raises(AdapterError, match="IA3 adapter"):
        check_adapter_config({"peft_type": "IA3", "r": 8}, "a", None)
    with pytest.raises(AdapterError, match="no positive integer rank"):
        check_adapter_config({"peft_type": "LORA"}, "a", None)


def test_a_local_adapter_is_read_where_it_is(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    assert read_adapter_config(str(tmp_path))["r"] == 4
    assert local_adapter_dir(str(tmp_path)) == str(tmp_path)
    with pytest.raises(AdapterError, match="cannot read its adapter_config.json"):
        read_adapter_config(str(tmp_path / "missing"))
    with pytest.raises(AdapterError, match="no adapter_config.json there"):
        local_adapter_dir(str(tmp_path / "missing"))


def test_an_hf_adapter_not_in_the_local_cache_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AdapterError, match="not in this node's Hugging Face cache"):
        read_adapter_config("hf://someone/some-lora")


def test_rows_of_an_adapter_share_one_routing_key_whatever_their_prompts():
    def body(model: str, system: str) -> dict:
        return {
            "model": model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}],
        }

    url = "/v1/chat/completions"
    adapters = frozenset({"sql"})
    long_a, long_b = "a" * 400, "b" * 400
    assert routing_key(url, body("sql", long_a), adapters) == routing_key(url, body("sql", long_b), adapters)
    assert routing_key(url, body("sql", ""), adapters) is not None
    assert routing_key(url, body("base", long_a), adapters) == prefix_key(url, body("base", long_a))
    assert routing_key(url, body("sql", long_a), adapters) != routing_key(url, body("poet", long_a), {"poet"})


def test_rows_and_tokens_are_counted_per_requested_name():
    table = pa.table(
        {
            "model": ["a", "b", "a", None],
            "prompt_tokens": [1, 2, 3, 9],
            "completion_tokens": [10, 20, 30, 90],
        }
    )
    one = rows_by_model(table)
    assert one == {
        "a": {"rows": 2, "prompt_tokens": 4, "completion_tokens": 40},
        "b": {"rows": 1, "prompt_tokens": 2, "completion_tokens": 20},
    }
    assert merge_rows_by_model([one, {"a": {"rows": 1, "prompt_tokens": 1, "completion_tokens": 1}}])[
        "a"
    ] == {
        "rows": 3,
        "prompt_tokens": 5,
        "completion_tokens": 41,
    }
    assert rows_by_model(table.drop_columns(["model"])) == {}


def _fake(**args) -> FakeEngine:
    return FakeEngine(EngineSpec("fake", "/m", "base", {"lora_modules": {"a": "/a", "b": "/b"}, **args}))


def _chat(custom_id: str, model: str) -> EngineRequest:
    return EngineRequest(
        custom_id, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}]}
    )


def test_the_fake_engine_loads_an_adapter_once_per_slot_and_names_it_in_its_answers():
    engine = _fake(max_loras=1)
    results = [engine._answer_now(_chat(f"r{i}", m)) for i, m in enumerate("aaabbba")]
    assert engine.adapter_loads == 3  # a, then b (swapping a out), then a again
    assert [r.body["model"] for r in results[:2]] == ["a", "a"]
    assert engine._answer_now(_chat("base", "base")).body["model"] == "base"
    assert engine.stats().adapter_loads == 3


def test_the_fake_engine_waits_for_an_idle_slot_before_swapping():
    engine = _fake(max_loras=1, adapter_load_seconds=0.01, decode_seconds_per_token=0.002)

    async def run():
        return await asyncio.gather(*(engine.generate(_chat(f"r{i}", m)) for i, m in enumerate("abab")))

    results = asyncio.run(run())
    assert all(r.status_code == 200 for r in results)
    # With one slot, requests of the other adapter wait for it: never two adapters held at once.
    assert len(engine._held) == 1 and engine.adapter_loads >= 2


def test_lora_slots_come_out_of_a_gpu_kv_budget_and_are_named_in_the_plan():
    from pipeline.adapters import lora_slots
    from pipeline.model_shape import ModelShape
    from pipeline.planner import DeviceBudget, lora_slot_bytes, plan_pool
    from pipeline.units import fmt_bytes

    # Llama-3-8B's shape: per layer and rank unit, qkv (3·4096 + 4096 + 2·1024) + o (2·4096) + gate_up
    # (2·4096 + 2·14336) + down (14336 + 4096) = 81,920 elements; plus the embeddings and LM head once,
    # 2 · (128,256 + 4096).
    shape = ModelShape(
        model_type="llama",
        layers=32,
        attention_heads=32,
        kv_heads=8,
        mlp_sizes=(14336,),
        head_dim=128,
        dtype="bfloat16",
        dtype_bytes=2,
        max_model_len_limit=8192,
        weights_bytes=16 * 2**30,
        hidden_size=4096,
        vocab_size=128_256,
    )
    assert lora_slot_bytes(shape, 1, 16) == 16 * (32 * 81_920 + 2 * (128_256 + 4096)) * 2
    assert lora_slot_bytes(shape, 4, 64) == 16 * lora_slot_bytes(shape, 1, 16)
    assert lora_slots({"lora_modules": {"a": "/a"}}) == (1, 16)
    assert lora_slots({"lora_modules": {"a": "/a"}, "max_loras": 4, "max_lora_rank": 64}) == (4, 64)
    assert lora_slots({"max_loras": 4}) is None
    budget = DeviceBudget(device="gpu", memory_bytes=24 * 2**30, utilization=0.9)
    plain = plan_pool(shape, budget, 8192)
    with_lora = plan_pool(shape, budget, 8192, lora=(4, 64))
    assert plain.kv_budget_bytes - with_lora.kv_budget_bytes == lora_slot_bytes(shape, 4, 64)
    assert with_lora.kv_blocks < plain.kv_blocks
    assert any(fmt_bytes(lora_slot_bytes(shape, 4, 64)) in note for note in with_lora.notes)


def test_lora_slots_of_the_embedded_model_match_what_a_vllm_worker_allocated():
    """6,541,504 bytes at max_loras 1, rank 8: the LoRA tensors of a live vLLM 0.32 worker serving SmolLM2-135M
    (its index buffers, 65,728 bytes at the default batch, are left out of the plan)."""
    from pipeline.model_shape import model_shape
    from pipeline.models import resolve_model
    from pipeline.planner import lora_slot_bytes

    shape = model_shape(resolve_model(None).path)
    assert lora_slot_bytes(shape, 1, 8) == 6_541_504 - 65_728


def test_max_lora_rank_is_one_vllm_takes():
    from pipeline.config import VllmEngineArgs

    assert VllmEngineArgs(max_lora_rank=64).max_lora_rank == 64
    with pytest.raises(ValueError, match="not 24: give 32"):
        VllmEngineArgs(max_lora_rank=24)


def test_the_cpu_lora_ops_give_base_rows_no_adapter_once_fixed():
    """vLLM 0.32's torch LoRA ops (its CPU path) index the slots with each row's adapter index, and a base row's -1
    picks the last slot; with the engine's fix a base row's LoRA delta is zero and adapter rows are unchanged."""
    pytest.importorskip("vllm")
    import torch
    import vllm.lora.ops.torch_ops.lora_ops as ops

    from pipeline.engines.vllm_lora_worker import _fix_cpu_base_rows

    weights = torch.stack([torch.full((1, 2, 3), 1.0), torch.full((1, 2, 3), 2.0)])  # 2 slots: rank 2, in 3
    inputs = torch.ones(3, 3)
    indices = torch.tensor([0, -1, 1])

    def shrink() -> torch.Tensor:
        out = torch.zeros(3, 2)
        ops.bgmv_shrink(inputs, weights, out, indices, 1.0)
        return out

    _fix_cpu_base_rows()
    fixed = shrink()
    assert fixed[1].abs().sum() == 0  # the base row: no adapter
    assert fixed[0].tolist() == [3.0, 3.0] and fixed[2].tolist() == [6.0, 6.0]


@pytest.mark.parametrize("model", [["sql"], {"name": "sql"}, 3, True])
def test_a_model_that_is_not_a_string_is_that_lines_error(model):
    validator = LineValidator({"base": "generate", "sql": "generate"})
    line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions"}
    line["body"] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    outcome = validator.check(json.dumps(line).encode(), 1, "in.jsonl")[0]
    assert (
        outcome.code == "invalid_request"
        and "body.model must be a string" in outcome.record["error"]["message"]
    )


def test_the_report_counts_rows_and_tokens_per_adapter_and_the_loads():
    from pipeline.observe.report import render_report
    from tests.report_charts import synthetic_job

    manifest, timeline, histograms = synthetic_job()
    assert "adapter loads" not in render_report(manifest, timeline, histograms)
    manifest["models"] = {
        "base": {
            "adapters": {"sql-lora": {"path": "/a", "rows": 7, "prompt_tokens": 70, "completion_tokens": 21}}
        }
    }
    manifest["adapter_loads"] = 3
    page = render_report(manifest, timeline, histograms)
    assert "adapter sql-lora" in page and "7 rows, 70 prompt + 21 completion tokens (on base)" in page
    assert "adapter loads" in page and "3 (into the engines" in page
