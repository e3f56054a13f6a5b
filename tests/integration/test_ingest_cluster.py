"""Ingest on a multi-node Ray cluster (three raylets on this machine): an s3:// input staged to s3:// is read by
tasks spread over the nodes, a local input by tasks on the driver's node; either way the result is the one-pass
result, and the job's accounting holds."""

# ruff: noqa: F811 - pytest fixtures imported from storage_fixtures are re-bound as test arguments
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.local import NodeSpec, mixed_cluster
from pipeline.config import JobConfig, StorageConfig
from pipeline.io.pieces import file_ranges
from pipeline.io.readers import input_source
from pipeline.io.staging import StagingArea
from pipeline.io.writers import output_target
from pipeline.runtime.ingest.tasks import ingest
from pipeline.runtime.job import run_job
from tests.integration.storage_fixtures import moto_s3  # noqa: F401
from tests.lines import chat_line, write_lines

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def cluster(moto_s3):
    """Head + two workers, one CPU each; started after the S3 server so every raylet's workers see its AWS_* env."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    specs = [NodeSpec(name=name, num_cpus=1) for name in ("head", "worker-a", "worker-b")]
    with mixed_cluster(specs) as local:
        ray.init(address=local.address, log_to_driver=False)
        try:
            yield local
        finally:
            ray.shutdown()


def shard(i: int, rows: int) -> bytes:
    lines = [chat_line(f"r{i}-{k:04d}", f"question {k} of shard {i}") for k in range(rows)]
    lines[5] = '{"custom_id": "broken", '  # invalid JSON: claims nothing
    lines[7] = chat_line("shared", f"claimed by shard {i}")  # the first shard's line 8 wins it
    return ("\n".join(lines) + "\n").encode()


def staged(staging: StagingArea) -> tuple[list[tuple], list[tuple]]:
    requests = []
    for part in staging.request_files():
        requests += [(r["custom_id"], r["source"], r["line"]) for r in staging.read_part(part).to_pylist()]
    errors = sorted(
        (r["source"], r["line"], json.loads(r["record"])["error"]["code"])
        for part in staging.parts("errors")
        for r in staging.read_part(part).to_pylist()
    )
    return sorted(requests), errors


def test_s3_input_is_read_on_several_nodes_and_the_job_accounts_for_every_line(cluster, moto_s3):
    bucket = moto_s3.bucket("ingest")
    shards, rows = 6, 400
    for i in range(shards):
        moto_s3.put(bucket, f"in/part-{i}.jsonl", shard(i, rows))
    storage = {"s3_endpoint_url": moto_s3.url}
    config = JobConfig.model_validate(
        {
            "input": f"s3://{bucket}/in/",
            "output": f"s3://{bucket}/out",
            "engine": {"backend": "fake", "fake": {"output_tokens": 2}},
            "resources": {"num_engines": 1, "cpus_per_engine": 0.5},
            "storage": storage,
        }
    )
    manifest = run_job(config, show_progress=False).manifest

    assert manifest["placement"]["ingest"] == manifest["ingest"]["tasks_by_node"]
    ingest_nodes = manifest["ingest"]["nodes"]
    assert len(ingest_nodes) >= 2 and set(ingest_nodes) <= set(cluster.node_ids.values())
    assert sum(manifest["ingest"]["tasks_by_node"]["read"].values()) == shards
    counts = manifest["counts"]
    total = shards * rows
    assert counts["total"] == total == manifest["input"]["lines"]
    assert counts["succeeded"] + counts["failed"] == total
    assert counts["by_error_code"] == {"invalid_json": shards, "duplicate_custom_id": shards - 1}
    results = b"".join(
        moto_s3.get(bucket, f"out/{s['name']}") for s in manifest["shards"]["results"]
    ).splitlines()
    ids = [json.loads(line)["custom_id"] for line in results]
    assert len(ids) == len(set(ids)) == total - 2 * shards + 1
    errors = [
        json.loads(line)
        for s in manifest["shards"]["errors"]
        for line in moto_s3.get(bucket, f"out/{s['name']}").splitlines()
    ]
    duplicates = [
        (e["error"]["source"], e["error"]["line"])
        for e in errors
        if e["error"]["code"] == "duplicate_custom_id"
    ]
    assert duplicates == [(f"s3://{bucket}/in/part-{i}.jsonl", 8) for i in range(1, shards)]


def test_a_large_s3_file_in_byte_ranges_on_several_nodes_matches_one_pass(cluster, moto_s3, tmp_path: Path):
    bucket = moto_s3.bucket("ranges")
    data = b"".join(shard(i, 300) for i in range(3))  # one file; its line numbers run on
    moto_s3.put(bucket, "in/big.jsonl", data)
    storage = StorageConfig(s3_endpoint_url=moto_s3.url)
    location = f"s3://{bucket}/in/big.jsonl"

    spread = output_target(f"s3://{bucket}/spread", storage).staging_area()
    spread.create()
    report = ingest(
        input_source(location, storage), MODEL, spread, job_id="j", range_bytes=len(data) // 7, buckets=3
    )
    serial = StagingArea(tmp_path / "serial")
    serial.create()
    expected = ingest(input_source(location, storage), MODEL, serial, job_id="j", parallel=False)

    assert len(report.placement["read"]) >= 2 and sum(report.placement["read"].values()) == 8
    assert staged(spread) == staged(serial)
    assert (report.lines, report.valid, report.invalid) == (expected.lines, expected.valid, expected.invalid)
    assert report.invalid_by_code == expected.invalid_by_code == {"invalid_json": 3, "duplicate_custom_id": 2}
    assert report.fingerprint == expected.fingerprint == input_source(location, storage).fingerprint()


def test_a_local_input_on_nodes_that_share_the_drivers_host_is_read_on_several_of_them(
    cluster, tmp_path: Path
):
    """Every node here runs on this host and reads its disk, so nothing pins the tasks (on a cluster of several
    hosts a local input is read on the driver's node only: tests/unit/test_ingest.py)."""
    lines = [chat_line(f"q{k:04d}", f"question {k}") for k in range(600)] + [chat_line("q0001", "again")]
    path = write_lines(tmp_path / "in.jsonl", lines)
    staging = StagingArea(tmp_path / "out")
    staging.create()
    report = ingest(path, MODEL, staging, job_id="j", range_bytes=path.stat().st_size // 9, buckets=3)
    serial = StagingArea(tmp_path / "serial")
    serial.create()
    expected = ingest(path, MODEL, serial, job_id="j", range_bytes=path.stat().st_size // 9, parallel=False)
    pieces = len(file_ranges(path.stat().st_size, path.stat().st_size // 9))
    assert len(report.placement["read"]) >= 2 and sum(report.placement["read"].values()) == pieces
    assert staged(staging) == staged(serial)
    assert (report.lines, report.valid, dict(report.invalid_by_code)) == (
        601,
        600,
        {"duplicate_custom_id": 1},
    )
    assert report.fingerprint == expected.fingerprint == input_source(str(path)).fingerprint()
