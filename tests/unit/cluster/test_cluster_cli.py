"""`nightshift node detect|start` through typer, with the vendor tools faked on PATH."""

from __future__ import annotations

import json

import pytest
from fake_smi import FakeTools
from typer.testing import CliRunner

from cluster.cli import node_app


@pytest.fixture
def tools(tmp_path, monkeypatch) -> FakeTools:
    for variable in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(variable, raising=False)
    return FakeTools(tmp_path / "bin", monkeypatch)


def invoke(*args: str):
    return CliRunner().invoke(node_app, list(args))


def test_detect_json_reports_devices_stacks_and_tags(tools: FakeTools):
    tools.prints("amd-smi", "amd-smi_static_mi300x-x8.json")

    result = invoke("detect", "--json")

    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["vendor"] == "rocm" and len(document["accelerators"]) == 8
    assert document["accelerators"][0]["engine_stack"]["stack"] == "vLLM ROCm image (ROCm 6.3+)"
    assert document["resources"] == {
        "accelerator:rocm": 8,
        "accelerator_model:MI300X": 8,
        "gpu_memory_gib:192": 8,
    }


def test_detect_table_shows_the_model_and_the_warning(tools: FakeTools):
    tools.prints("nvidia-smi", "nvidia-smi_p100x2.csv")

    result = invoke("detect")

    assert result.exit_code == 0, result.output
    assert "Tesla P100-SXM2-16GB" in result.stdout
    assert "compute capability 6.0" in result.stdout
    assert '"accelerator:cpu": 1' in result.stdout  # both GPUs unsupported: the node would join as CPU


def test_detect_on_a_cpu_node(tools: FakeTools):
    result = invoke("detect", "--json")
    document = json.loads(result.stdout)
    assert document["vendor"] == "cpu" and document["engine_stack"]["stack"] == "vllm-cpu"


def test_start_dry_run_prints_the_command_with_tags(tools: FakeTools):
    tools.prints("nvidia-smi", "nvidia-smi_h100x8.csv")

    result = invoke("start", "--head", "--dry-run", "--", "--block", "--port=6380")

    assert result.exit_code == 0, result.output
    assert "--num-gpus=8" in result.output
    assert '"accelerator:cuda":8' in result.output
    assert result.output.rstrip().endswith("--block --port=6380")


def test_start_dry_run_explains_the_rocr_translation(tools: FakeTools, monkeypatch):
    tools.prints("amd-smi", "amd-smi_static_mi300x-x8.json")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "0,1,2,3")

    result = invoke("start", "--address", "10.0.0.1:6379", "--dry-run")

    assert result.exit_code == 0, result.output
    assert "HIP_VISIBLE_DEVICES=0,1,2,3" in result.output
    assert "refused by Ray" in result.output


def test_start_without_head_or_address_is_a_usage_error(tools: FakeTools):
    result = invoke("start", "--dry-run")
    assert result.exit_code == 2
    assert "--head" in result.output and "--address" in result.output


def test_start_with_a_bad_visibility_variable_is_a_usage_error(tools: FakeTools, monkeypatch):
    tools.prints("nvidia-smi", "nvidia-smi_h100x8.csv")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "12")

    result = invoke("start", "--head", "--dry-run")

    assert result.exit_code == 2
    assert "CUDA_VISIBLE_DEVICES='12'" in result.output
