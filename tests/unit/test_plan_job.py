"""`nightshift plan --config JOB.yaml`: every pool of a job planned with its own model, engine args and device.

No Ray, no vLLM: the GPU pool's model is a synthetic 70B-shaped checkpoint (config.json and safetensors headers
only), the CPU pools serve the embedded model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.model_shape import model_shape
from pipeline.planner import DeviceBudget, plan_pool
from pipeline.topology import Topology
from pipeline.units import GiB
from tests.lines import MODEL_NAME, chat_line, write_lines
from tests.unit.planner_models import LLAMA3_70B, llama_tensors, make_model, plan_app, write_header_only


@pytest.fixture
def llama70b(tmp_path) -> Path:
    directory = make_model(tmp_path, LLAMA3_70B, name="llama-3-70b")
    write_header_only(directory / "model.safetensors", llama_tensors(LLAMA3_70B))
    return directory


@pytest.fixture
def job_file(tmp_path, llama70b, embedded_model) -> Path:
    """Three pools: the job's (embedded) model on CPU, the same model on CPU at TP=3 with 1 GiB of KV space, and the
    70B checkpoint on GPUs at TP=1, which it does not fit."""
    path = tmp_path / "job.yaml"
    pools = [
        {"name": "cpu-small"},
        {
            "name": "cpu-sharded",
            "engine_overrides": {"tensor_parallel_size": 3, "cpu_kvcache_space_gib": 1},
        },
        {
            "name": "gpu-big",
            "model": str(llama70b),
            "gpus_per_engine": 1,
            "engine_overrides": {"max_model_len": 8192},
        },
    ]
    path.write_text(yaml.safe_dump({"engine": {"vllm": {"cpu_kvcache_space_gib": 2}}, "pools": pools}))
    return path


def plan(*args: str):
    return CliRunner().invoke(plan_app(), ["plan", *args])


def sections(output: str) -> dict[str, str]:
    """The text under each `pool NAME (device)` title, up to the next pool or model."""
    found: dict[str, str] = {}
    name = None
    for line in output.splitlines():
        if line.startswith("pool "):
            name = line.split()[1]
            found[name] = ""
        elif line.startswith("model "):
            name = None
        elif name:
            found[name] += line + "\n"
    return found


def test_every_pool_is_planned_with_its_own_model_args_and_device(job_file, llama70b, embedded_model):
    result = plan("--config", str(job_file), "--gpu-memory", "80GiB")
    assert result.exit_code == 0, result.output
    out = result.output
    assert [line for line in out.splitlines() if line.startswith("pool ")] == [
        "pool cpu-small (cpu)",
        "pool cpu-sharded (cpu)",
        "pool gpu-big (gpu)",
    ]
    # The two pools of the embedded model share its header; the 70B pool has its own.
    assert out.count(f"model  {MODEL_NAME}  ") == 1 and out.count(f"model  {llama70b}  ") == 1
    assert out.index(f"model  {MODEL_NAME}") < out.index("pool cpu-small") < out.index("pool cpu-sharded")
    assert out.index("pool cpu-sharded") < out.index(f"model  {llama70b}") < out.index("pool gpu-big")
    pools = sections(out)

    embedded = model_shape(embedded_model.path)
    cpu = plan_pool(embedded, DeviceBudget.cpu(2))
    assert cpu.kv_capacity_tokens == 93_184  # the embedded model at VLLM_CPU_KVCACHE_SPACE=2, as measured
    assert f"{cpu.kv_capacity_tokens:,}" in pools["cpu-small"]
    assert f"({cpu.kv_blocks:,} blocks)" in pools["cpu-small"]
    assert "VLLM_CPU_KVCACHE_SPACE=2" in pools["cpu-small"] and "TP=" not in pools["cpu-small"]

    sharded = plan_pool(embedded, DeviceBudget.cpu(1), topology=Topology(tensor_parallel_size=3))
    assert "TP=3 PP=1" in pools["cpu-sharded"] and "VLLM_CPU_KVCACHE_SPACE=1" in pools["cpu-sharded"]
    assert f"{sharded.kv_capacity_tokens:,}" in pools["cpu-sharded"]

    big = plan_pool(model_shape(llama70b), DeviceBudget.gpu(80 * GiB, 0.9), context=8192)
    tp = big.suggested_tensor_parallel_size
    assert tp > 1
    advice = f"the smallest tensor_parallel_size that holds them and one 8,192-token sequence is {tp}"
    assert advice in pools["gpu-big"]
    assert not any(
        "smallest tensor_parallel_size" in text for name, text in pools.items() if name != "gpu-big"
    )
    assert "80 GiB × 0.9 − weights − reserve" in pools["gpu-big"] and "job file" in pools["gpu-big"]


def test_json_is_a_list_of_named_pools(job_file, llama70b, embedded_model):
    result = plan("--config", str(job_file), "--gpu-memory", "80GiB", "--gpus-per-node", "4", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert record["config"] == str(job_file)
    by_name = {pool["name"]: pool for pool in record["pools"]}
    assert list(by_name) == ["cpu-small", "cpu-sharded", "gpu-big"]
    small, sharded, big = by_name.values()
    assert (small["device"], small["model"]["name"], small["model"]["path"]) == (
        "cpu",
        MODEL_NAME,
        embedded_model.path,
    )
    assert small["kv_capacity_tokens"] == 93_184 and "suggested_tensor_parallel_size" not in small
    assert sharded["tensor_parallel_size"] == 3 and sharded["budget"]["cpu_kv_space_bytes"] == GiB
    assert (big["device"], big["model"]["path"], big["context"]) == ("gpu", str(llama70b), 8192)
    assert big["budget"]["devices_per_node"] == 4 and big["kv_capacity_tokens"] == 0
    assert big["suggested_tensor_parallel_size"] > 1 and big["suggested_pipeline_parallel_size"] == 1


def test_input_is_measured_per_model(job_file, tmp_path):
    lines = [chat_line(f"r{i}", "hello " * (10 * i + 1), max_tokens=100) for i in range(5)]
    batch = write_lines(tmp_path / "batch.jsonl", lines)
    result = plan("--config", str(job_file), "--gpu-memory", "80GiB", "--input", str(batch), "--json")
    assert result.exit_code == 0, result.output
    small, sharded, big = json.loads(result.output)["pools"]
    assert small["input"]["sequences"] == sharded["input"]["sequences"] == 5
    assert small["context_source"] == "fitted to --input"
    # No request names the 70B model: its pool is planned at its own context, its tokenizer never loaded.
    assert big["input"] is None and big["context_source"] == "job file"
    assert any("no valid request" in note for note in big["notes"])


def test_a_gpu_pool_without_gpu_memory_is_refused_naming_it(job_file):
    result = plan("--config", str(job_file))
    assert result.exit_code == 2
    assert "pool 'gpu-big'" in result.output and "--gpu-memory" in result.output
    assert "cpu-small" not in result.output


def test_a_job_of_cpu_pools_needs_no_gpu_memory(tmp_path, embedded_model):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"pools": [{"name": "only"}]}))
    result = plan("--config", str(path))
    assert result.exit_code == 0, result.output
    assert "pool only (cpu)" in result.output


@pytest.mark.parametrize(
    "flags",
    [
        ["--model", "embedded:smollm2"],
        ["--tensor-parallel-size", "1"],  # a value given is refused even when it is the default
        ["--max-model-len", "4096", "--kv-cache-dtype", "fp8"],
        ["--cpu-kvcache-space", "4"],
    ],
)
def test_flags_the_job_file_sets_are_refused_beside_it(job_file, flags):
    result = plan("--config", str(job_file), "--gpu-memory", "80GiB", *flags)
    assert result.exit_code == 2
    refused, _, why = result.output.removeprefix("error: ").partition(" cannot go with --config")
    assert set(refused.split(", ")) == {flag for flag in flags if flag.startswith("--")}
    assert "the job file sets" in why and "per pool" in why


def test_a_job_file_that_does_not_exist_is_named(tmp_path):
    result = plan("--config", str(tmp_path / "missing.yaml"))
    assert result.exit_code == 2 and "missing.yaml does not exist" in result.output


def test_a_dataset_jobs_table_is_measured_on_its_rendered_prompts(tmp_path, embedded_model):
    """--input is the job's table: the rows its template renders are measured (the one it cannot render is not),
    and the context is fitted to the longest rendered prompt plus the job's max_tokens."""
    rows = [{"id": i, "text": "hello " * (10 * i + 1)} for i in range(5)] + [{"id": 5, "text": None}]
    table = write_lines(tmp_path / "table.jsonl", [json.dumps(row) for row in rows])
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {"pools": [{"name": "only"}], "dataset": {"template": "{{ text }}", "max_tokens": 100}}
        )
    )
    result = plan("--config", str(job), "--input", str(table), "--json")
    assert result.exit_code == 0, result.output
    (pool,) = json.loads(result.output)["pools"]
    assert pool["input"]["sequences"] == 5 and pool["context_source"] == "fitted to --input"
    missing = tmp_path / "missing.yaml"
    missing.write_text(yaml.safe_dump({"pools": [{"name": "only"}], "dataset": {"template": "{{ body }}"}}))
    result = plan("--config", str(missing), "--input", str(table))
    assert result.exit_code != 0 and "does not have: body (it has: id, text)" in result.output
