"""The staging area of an s3:// OUTPUT, in the bucket itself, against a real S3 endpoint (moto's server on loopback,
no mocks in boto): layout and whole-object parts, reading back from another machine (an empty local cache), the
work list read by the queue, finalize + commit into the bucket, and the unfinished-job check of preflight. No Ray."""

# ruff: noqa: F811 - pytest fixtures imported from storage_fixtures are re-bound as test arguments

from __future__ import annotations

import asyncio
import io
import json
import pickle
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.config import JobConfig, StorageConfig
from pipeline.io.locations import RetryStats
from pipeline.io.staging import ObjectStoreFiles, StagingArea
from pipeline.io.writers import S3Target, local_job_dir, output_target
from pipeline.runtime.commit.finalize import commit, write_outputs
from pipeline.runtime.engines.work_queue import WorkQueue
from pipeline.runtime.job import load_resumable
from pipeline.runtime.preflight import PreflightError, check_output_target
from pipeline.state import JobState
from tests.integration.s3_staging import FAST_RETRIES, error_row, request, result_row
from tests.integration.storage_fixtures import moto_s3  # noqa: F401
from tests.lines import chat_line
from tests.staged_rows import staged_rows


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    """This machine's NIGHTSHIFT_HOME (scratch and the read cache live under it)."""
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path / "home-a"))
    return tmp_path / "home-a"


@pytest.fixture
def storage(moto_s3) -> StorageConfig:
    return StorageConfig(s3_endpoint_url=moto_s3.url, **FAST_RETRIES)


def s3_target(moto_s3, storage: StorageConfig, prefix: str = "runs/one") -> tuple[str, S3Target]:
    bucket = moto_s3.bucket("stg")
    target = output_target(f"s3://{bucket}/{prefix}", storage)
    assert isinstance(target, S3Target)
    return bucket, target


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_parts_are_whole_objects_under_output_staging(moto_s3, storage, home):
    bucket, target = s3_target(moto_s3, storage)
    staging = target.staging_area()
    assert staging.describe() == f"s3://{bucket}/runs/one/_staging"
    staging.create()
    assert not staging.exists()  # a prefix exists once something is in it

    state = JobState(job_id="j1", config=JobConfig())
    staging.write_job(state)
    staging.write_requests([request(f"q{i}", i) for i in range(5)])
    staging.write_rows("results", [result_row("b"), result_row("a")])
    staging.write_rows("errors", [error_row(7)], prefix="validate")
    staging.write_rows("errors", [error_row(9, "e", "engine_error")])

    assert staging.exists()
    keys = moto_s3.keys(bucket)
    assert all(k.startswith("runs/one/_staging/") for k in keys)
    assert [k.split("/")[3] for k in keys] == ["errors", "errors", "job.json", "requests", "results"]
    assert not [
        k for k in keys if k.rsplit("/", 1)[-1].startswith(".") or k.endswith(".tmp")
    ]  # no temp names
    (result_key,) = [k for k in keys if "/results/" in k]
    part = pq.read_table(io.BytesIO(moto_s3.get(bucket, result_key)))  # a complete Parquet file on its own
    assert part.column("custom_id").to_pylist() == ["a", "b"]  # sorted within the part
    assert json.loads(moto_s3.get(bucket, "runs/one/_staging/job.json")) == state.model_dump(mode="json")
    assert all(
        p.is_relative_to(staging.files.cache_dir) for p in files_under(home)
    )  # locally: a read cache only


def test_another_machine_reads_what_this_one_staged(moto_s3, storage, home, tmp_path, monkeypatch):
    bucket, target = s3_target(moto_s3, storage)
    writer = target.staging_area()
    state = JobState(job_id="j2", config=JobConfig(), ingested=True)
    writer.write_job(state)
    writer.write_requests([request(f"q{i}", i) for i in range(7)])
    writer.write_rows("results", [result_row("m"), result_row("z")])
    writer.write_rows("results", [result_row("c")])
    writer.write_rows("errors", [error_row(3)], prefix="validate")
    writer.write_rows("errors", [error_row(4, "x", "engine_error")])
    assert files_under(writer.files.cache_dir)  # this machine keeps what it wrote

    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path / "home-b"))  # a machine that never saw the job
    reader = output_target(f"s3://{bucket}/runs/one", storage).staging_area()
    assert reader.files.cache_dir != writer.files.cache_dir and not files_under(reader.files.cache_dir)
    assert reader.exists() and reader.read_job() == state
    assert reader.num_rows(reader.request_files()) == 7
    assert reader.count("results") == 3 and reader.count("errors") == 2
    assert [r.custom_id for r in staged_rows(reader, "results")] == ["c", "m", "z"]
    assert sorted(reader.finished_ids()) == ["c", "m", "x", "z"]  # not the validation error
    assert sum(reader.iter_column("results", "completion_tokens")) == 15
    assert sorted(reader.iter_column("errors", "error_code")) == ["engine_error", "invalid_json"]
    assert len(files_under(reader.files.cache_dir)) == 5  # every part fetched once, then read locally


def test_read_cache_never_serves_a_part_the_bucket_no_longer_lists(moto_s3, storage, home):
    _, target = s3_target(moto_s3, storage)
    staging = target.staging_area()
    staging.write_requests([request("q1", 1)])
    staging.write_rows("errors", [error_row(1)], prefix="validate")
    staging.write_rows("errors", [error_row(2, "e", "engine_error")])
    staging.discard_ingest()  # an interrupted validation pass is redone whole
    assert staging.request_files() == []
    assert [r.error_code for r in staged_rows(staging, "errors")] == ["engine_error"]
    assert len(files_under(staging.files.cache_dir)) == 1


def test_pending_work_list_without_finished_requests(moto_s3, storage, home):
    bucket, target = s3_target(moto_s3, storage)
    staging = target.staging_area()
    staging.write_requests([request(f"q{i:02d}", i) for i in range(10)])
    staging.write_requests([request(f"q{i:02d}", i) for i in range(10, 14)])
    assert staging.pending_requests(set()) == staging.request_files()

    first = staging.pending_requests({"q00", "q03", "q10", "q11", "q12", "q13"})
    assert len(first) == 1 and first[0].startswith(f"{bucket}/runs/one/_staging/pending/")
    second = staging.pending_requests({"q00"})  # a later resume replaces the earlier list
    assert len(second) == 2 and not set(first) & set(second)
    assert [k for k in moto_s3.keys(bucket) if "/pending/" in k] == sorted(p.split("/", 1)[1] for p in second)

    # The queue actor gets the storage pickled (as Ray ships it) and reads the list from the bucket.
    shipped = pickle.loads(pickle.dumps(staging.files))
    assert shipped._fs is None
    shipped.cache_dir = home / "elsewhere"  # no cache: every part comes from S3
    queue = WorkQueue(second, read_rows=3, files_on=shipped)

    async def drain() -> list[str]:
        ids = []
        while (lease := await queue.lease("e", "p/0", 4)) is not None:
            ids += lease[3].column("custom_id").to_pylist()
        return ids

    assert sorted(asyncio.run(drain())) == [f"q{i:02d}" for i in range(1, 14)]


class FlakyS3:
    """The real s3fs filesystem, whose first `fails` calls of `method` break off like a dropped connection."""

    def __init__(self, fs, method: str, fails: int) -> None:
        self._fs, self._method, self.fails = fs, method, fails

    def __getattr__(self, name):
        attr = getattr(self._fs, name)
        if name != self._method:
            return attr

        def call(*args, **kwargs):
            if self.fails:
                self.fails -= 1
                raise ConnectionResetError("connection reset by peer")
            return attr(*args, **kwargs)

        return call


@pytest.mark.parametrize("method", ["pipe_file", "cat_file", "ls"])
def test_transient_errors_are_retried(moto_s3, storage, home, method):
    bucket, target = s3_target(moto_s3, storage)
    flaky = FlakyS3(target.fs, method, fails=2)
    staging = StagingArea(target.prefix, ObjectStoreFiles(storage, home / "no-cache", fs=flaky))
    staging.files._remember = lambda path, data: None  # every read goes to the bucket
    before = RetryStats.snapshot()
    staging.write_rows("results", [result_row("a")])
    assert [r.custom_id for r in staged_rows(staging, "results")] == ["a"]
    assert flaky.fails == 0 and RetryStats.since(before)["retries"] == 2
    assert len([k for k in moto_s3.keys(bucket) if "/results/" in k]) == 1


def test_finalize_and_commit_into_the_bucket(moto_s3, storage, home):
    bucket, target = s3_target(moto_s3, storage)
    staging = target.staging_area()
    ids = [f"r{i:03d}" for i in range(57)]
    for start in range(0, len(ids), 10):  # unsorted parts
        staging.write_rows("results", [result_row(c) for c in reversed(ids[start : start + 10])])
    staging.write_rows("errors", [error_row(5), error_row(2)])
    moto_s3.put(bucket, "runs/one/notes.txt", b"not ours")

    summary = write_outputs(target, staging, rows_per_shard=20, expected_rows=59)
    assert [s.name for s in summary.shards.results] == [f"results-{k:05d}-of-00003.jsonl" for k in range(3)]
    assert any("/_staging/" in k for k in moto_s3.keys(bucket))  # shards alone are no commit
    commit(target, staging, {"counts": summary.counts.model_dump(mode="json")})

    keys = moto_s3.keys(bucket)
    assert keys == sorted(
        ["runs/one/errors-00000-of-00001.jsonl", "runs/one/manifest.json", "runs/one/notes.txt"]
        + [f"runs/one/results-{k:05d}-of-00003.jsonl" for k in range(3)]
    )  # `_staging/` gone from the bucket
    assert not local_job_dir(target.describe()).exists()  # spills, spools and the read cache gone too
    seen = [
        json.loads(line)["custom_id"]
        for k in range(3)
        for line in moto_s3.get(bucket, f"runs/one/results-{k:05d}-of-00003.jsonl").splitlines()
    ]
    assert seen == ids
    assert not staging.exists()


def test_unfinished_job_in_the_bucket_is_refused_then_resumable(moto_s3, storage, home, tmp_path):
    bucket, target = s3_target(moto_s3, storage, prefix="out")
    output = f"s3://{bucket}/out"
    local_in = tmp_path / "in.jsonl"
    local_in.write_text(chat_line("a", "x") + "\n")
    config = JobConfig.model_validate(
        {"input": str(local_in), "output": output, "storage": storage.model_dump(), "job_id": "jb"}
    )
    target.staging_area().write_job(JobState(job_id="jb", config=config))

    with pytest.raises(PreflightError, match=r"unfinished job \(_staging/\):") as info:
        check_output_target(output, overwrite=False, storage=storage)
    assert f"nightshift resume {output}" in str(info.value) and f"{output}/_staging" in str(info.value)
    assert check_output_target(output, overwrite=False, storage=storage, resume=True)

    # `resume` from a machine that has only the URL and the endpoint; the endpoint given there wins.
    resumed = load_resumable(output, {"s3_endpoint_url": moto_s3.url, "s3_region": None})
    assert resumed.job_id == "jb" and resumed.output == output and resumed.input == str(local_in)
    assert (
        resumed.storage.s3_endpoint_url == moto_s3.url and resumed.storage.retries == FAST_RETRIES["retries"]
    )
    with pytest.raises(PreflightError, match="nothing to resume"):
        load_resumable(f"s3://{bucket}/elsewhere", {"s3_endpoint_url": moto_s3.url})
