"""LoRA adapters on S3: read for the driver's check, and staged once per node into $NIGHTSHIFT_HOME/adapters (a
moto S3 server on loopback; no Ray: the staging is what an engine actor runs before its engine starts)."""

# ruff: noqa: F811 - pytest fixtures imported from storage_fixtures are re-bound as test arguments
from __future__ import annotations

import json

import pytest

from pipeline.adapters import AdapterError
from pipeline.io.adapter_files import check_adapters, local_adapter_dir, read_adapter_config, stage_adapters
from tests.integration.storage_fixtures import moto_s3  # noqa: F401


@pytest.fixture
def adapter_on_s3(moto_s3, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.url)
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path / "home"))
    bucket = moto_s3.bucket("adapters")
    moto_s3.put(bucket, "sql/adapter_config.json", json.dumps({"peft_type": "LORA", "r": 8}).encode())
    moto_s3.put(bucket, "sql/adapter_model.safetensors", b"weights")
    return moto_s3, bucket, f"s3://{bucket}/sql"


def test_an_s3_adapter_is_checked_where_it_is_and_staged_once_per_node(adapter_on_s3, tmp_path):
    s3, bucket, source = adapter_on_s3
    assert read_adapter_config(source)["r"] == 8
    check_adapters({"lora_modules": {"sql": source}, "max_lora_rank": 8})
    first = local_adapter_dir(source)
    assert first.startswith(str(tmp_path / "home" / "adapters"))
    with open(f"{first}/adapter_model.safetensors", "rb") as fh:
        assert fh.read() == b"weights"
    # A second engine of the node (or a later job) reuses the copy: nothing is fetched again.
    s3.put(bucket, "unrelated/file", b"x")
    assert stage_adapters({"lora_modules": {"sql": source}}) == {"sql": first}
    # Rewritten under the same prefix, it is staged anew.
    s3.put(bucket, "sql/adapter_model.safetensors", b"retrained")
    again = local_adapter_dir(source)
    assert again != first
    with open(f"{again}/adapter_model.safetensors", "rb") as fh:
        assert fh.read() == b"retrained"


def test_an_s3_prefix_without_an_adapter_is_refused_before_any_work(adapter_on_s3):
    _, bucket, _ = adapter_on_s3
    with pytest.raises(AdapterError, match="cannot read its adapter_config.json"):
        check_adapters({"lora_modules": {"x": f"s3://{bucket}/missing"}})
    with pytest.raises(AdapterError, match="--max-lora-rank 8"):
        check_adapters({"lora_modules": {"sql": f"s3://{bucket}/sql"}, "max_lora_rank": 1})


def test_an_s3_adapter_is_read_with_the_jobs_storage_settings(moto_s3, monkeypatch, tmp_path):
    """No endpoint in the environment: the job's storage.s3_endpoint_url is what reaches it, on the driver and in
    the engine actor (EngineSpec.adapter_storage)."""
    from pipeline.config import StorageConfig

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path / "home"))
    bucket = moto_s3.bucket("adapters")
    moto_s3.put(bucket, "sql/adapter_config.json", json.dumps({"peft_type": "LORA", "r": 8}).encode())
    storage = StorageConfig(s3_endpoint_url=moto_s3.url)
    args = {"lora_modules": {"sql": f"s3://{bucket}/sql"}}
    check_adapters(args, storage)
    staged = stage_adapters(args, storage)
    with open(f"{staged['sql']}/adapter_config.json") as fh:
        assert json.load(fh)["r"] == 8


def test_the_job_hands_its_storage_settings_to_its_engines():
    from pipeline.config import JobConfig, StorageConfig
    from pipeline.job_plan import JobPlan

    config = JobConfig(storage=StorageConfig(s3_endpoint_url="http://127.0.0.1:9"))
    assert JobPlan.of(config).engine_spec(None).adapter_storage.s3_endpoint_url == "http://127.0.0.1:9"
