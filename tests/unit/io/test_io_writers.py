"""Finalize's external sort into range-partitioned shards (JSONL and Parquet), manifest sha256 of Parquet shards,
flattened Parquet columns, and local output targets."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.io.staging import StagingArea
from pipeline.io.writers import PARQUET_OUTPUT_SCHEMA, flatten_records, local_job_dir, output_target
from pipeline.runtime.commit import finalize as finalize_module
from pipeline.runtime.commit.finalize import AccountingError, write_outputs
from tests.staged_rows import error_row, result_row, stage_randomly, unicode_ids


@pytest.fixture
def staging(tmp_path: Path) -> StagingArea:
    area = StagingArea(tmp_path / "out")
    area.create()
    return area


# (50, 2): many map tasks, and buckets placed from a poor sample (two parts): the boundaries are exact all the same.
@pytest.mark.parametrize("map_rows, sample_parts", [(100_000, 128), (50, 2)])
def test_external_sort_matches_a_plain_sort(
    staging: StagingArea, monkeypatch, map_rows: int, sample_parts: int
):
    monkeypatch.setattr(finalize_module, "MAP_TASK_ROWS", map_rows)
    monkeypatch.setattr(finalize_module, "SAMPLE_PARTS", sample_parts)
    monkeypatch.setattr(finalize_module, "SPILL_FLUSH_BYTES", 10_000)  # many small pieces
    ids = unicode_ids(1000)
    stage_randomly(staging, "results", [result_row(cid) for cid in ids])
    sources = ["b.jsonl", "a.jsonl", "s3://x/c.jsonl"]
    errors = [error_row(line, sources[line % 3]) for line in range(1, 130)]
    stage_randomly(staging, "errors", errors, seed=3)
    output = Path(staging.root).parent

    summary = write_outputs(output, staging, rows_per_shard=97, expected_rows=1000 + 129)

    shards = summary.shards.results
    assert [s.rows for s in shards] == [97] * 10 + [30]
    written = []
    for shard in shards:
        data = (output / shard.name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard.sha256 and len(data) == shard.bytes
        ids_in_shard = [json.loads(x)["custom_id"] for x in data.decode().splitlines()]
        assert (ids_in_shard[0], ids_in_shard[-1]) == (shard.first_custom_id, shard.last_custom_id)
        written.extend(ids_in_shard)
    assert written == sorted(ids, key=lambda s: s.encode())  # UTF-8 byte order across shard boundaries
    error_records = [
        json.loads(x) for s in summary.shards.errors for x in (output / s.name).read_text().splitlines()
    ]
    assert [(e["error"]["source"], e["error"]["line"]) for e in error_records] == sorted(
        (e.source, e.line) for e in errors
    )
    assert not (staging.scratch / "finalize-results").exists()  # spill files cleaned up


def test_parquet_shards_range_partitioned_with_manifest_sha256(staging: StagingArea):
    ids = [f"id-{i:04d}" for i in range(250)]
    stage_randomly(staging, "results", [result_row(cid) for cid in ids])
    staging.write_rows("errors", [error_row(7, custom_id="bad"), error_row(2)])
    output = Path(staging.root).parent

    summary = write_outputs(output, staging, rows_per_shard=100, expected_rows=252, format="parquet")

    names = [s.name for s in summary.shards.results]
    assert names == [f"results-{k:05d}-of-00003.parquet" for k in range(3)]
    previous_last = None
    for shard in summary.shards.results:
        data = (output / shard.name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard.sha256 and len(data) == shard.bytes
        table = pq.read_table(output / shard.name)
        assert table.schema == PARQUET_OUTPUT_SCHEMA
        got = table.column("custom_id").to_pylist()
        assert got == sorted(got) and len(got) == shard.rows
        assert (got[0], got[-1]) == (shard.first_custom_id, shard.last_custom_id)
        if previous_last is not None:
            assert previous_last < got[0]
        previous_last = got[-1]
        row = table.slice(0, 1).to_pylist()[0]
        assert row["content"] == f"answer {row['custom_id']}" and row["finish_reason"] == "stop"
        assert (row["status_code"], row["prompt_tokens"], row["completion_tokens"]) == (200, 3, 5)
        assert json.loads(row["response"])["body"]["usage"]["total_tokens"] == 8 and row["error"] is None
    (errors,) = summary.shards.errors
    table = pq.read_table(output / errors.name)
    assert [json.loads(e)["line"] for e in table.column("error").to_pylist()] == [2, 7]
    assert table.column("status_code").to_pylist() == [None, None]


def test_empty_parquet_output_is_one_readable_empty_shard(staging: StagingArea):
    summary = write_outputs(
        Path(staging.root).parent, staging, rows_per_shard=10, expected_rows=0, format="parquet"
    )
    (shard,) = summary.shards.results
    table = pq.read_table(Path(staging.root).parent / shard.name)
    assert table.num_rows == 0 and table.schema == PARQUET_OUTPUT_SCHEMA
    assert shard.sha256 == hashlib.sha256((Path(staging.root).parent / shard.name).read_bytes()).hexdigest()


def test_duplicate_result_across_many_shards_commits_nothing(staging: StagingArea):
    rows = [result_row(f"r{i:03d}") for i in range(50)] + [result_row("r025")]
    stage_randomly(staging, "results", rows)
    output = Path(staging.root).parent
    (output / "results-00000-of-00001.jsonl").write_text("previous job\n")
    with pytest.raises(AccountingError, match="r025"):
        write_outputs(output, staging, rows_per_shard=7, expected_rows=51)
    assert (output / "results-00000-of-00001.jsonl").read_text() == "previous job\n"  # nothing touched


def test_flatten_records_shapes():
    completion = {
        "id": "x",
        "custom_id": "c",
        "response": {
            "status_code": 200,
            "body": {"object": "text_completion", "choices": [{"text": "t", "finish_reason": "length"}]},
        },
        "error": None,
    }
    failed = {
        "id": "y",
        "custom_id": "d",
        "response": {"status_code": 400, "body": {"error": {"code": "context_length_exceeded"}}},
        "error": None,
    }
    table = flatten_records([json.dumps(completion), json.dumps(failed)])
    rows = table.to_pylist()
    assert rows[0]["content"] == "t" and rows[0]["prompt_tokens"] is None
    assert rows[1]["status_code"] == 400 and rows[1]["content"] is None
    assert json.loads(rows[1]["response"])["body"]["error"]["code"] == "context_length_exceeded"


def test_http_targets_stage_locally_by_url_s3_targets_in_the_bucket(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path))
    a = output_target("https://h/out?sig=1")
    b = output_target("https://h/out?sig=1")
    assert not a.stages_in_output
    staged = a.staging_area().root
    assert staged == b.staging_area().root == f"{local_job_dir('https://h/out?sig=1')}/_staging"
    assert Path(staged).is_relative_to(tmp_path / "jobs")
    assert output_target("https://h/other").staging_area().root != staged
    assert a.describe() == "https://h/out?…"
    local = output_target(str(tmp_path / "o"))
    assert local.is_local and local.staging_area().root == str(tmp_path / "o" / "_staging")
    s3 = output_target("s3://bkt/runs/one/")
    assert s3.stages_in_output
    assert s3.staging_area().describe() == "s3://bkt/runs/one/_staging"
    assert s3.staging_area().scratch == local_job_dir("s3://bkt/runs/one")  # spills stay on local disk


def test_staged_parts_shards_and_manifest_reach_the_disk_before_they_count(staging: StagingArea, monkeypatch):
    """After a power cut a part or a shard is whole or absent: each is fsynced before its name (a part's rename)
    or the manifest that vouches for it exists, and the manifest's directory entry is fsynced too."""
    import os

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd)
    )
    monkeypatch.setattr(
        os, "replace", lambda a, b: events.append(("replace", f"{a} {b}")) or real_replace(a, b)
    )

    staging.write_rows("results", [result_row(f"r{i:03d}", line=i + 1) for i in range(20)])
    fsynced, renamed = events[0], events[1]
    (part,) = staging.parts("results")
    assert fsynced[0] == "fsync" and renamed == ("replace", f"{fsynced[1]} {part}")

    events.clear()
    output = Path(staging.root).parent
    summary = write_outputs(output, staging, rows_per_shard=7, expected_rows=20)
    finalize_module.commit(output, staging, summary.manifest_fields())
    manifest_at = next(
        i for i, (kind, what) in enumerate(events) if kind == "replace" and what.endswith("/manifest.json")
    )
    before = {what for kind, what in events[:manifest_at] if kind == "fsync"}
    assert {str(output / s.name) for s in summary.shards.results} <= before and str(output) in before
    assert ("fsync", str(output)) in events[manifest_at:]
