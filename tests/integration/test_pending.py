"""A resumed job's work list: every request without a row an engine staged, listed by Ray Data's anti-join on the
cluster (local staging and an s3:// OUTPUT), with the driver reading only row counts — or, for a small job, by the
driver itself."""

# ruff: noqa: F811 - pytest fixtures imported from storage_fixtures are re-bound as test arguments

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import StorageConfig
from pipeline.io.staging import StagingArea
from pipeline.io.writers import output_target
from pipeline.runtime.commit import pending
from pipeline.runtime.commit.pending import PendingWork, pending_work
from tests.integration.s3_staging import FAST_RETRIES, error_row, request, result_row
from tests.integration.storage_fixtures import moto_s3  # noqa: F401

# The S3 test credentials are in the environment before Ray starts its workers.
pytestmark = pytest.mark.usefixtures("moto_s3", "local_ray")


def _staged_job(staging: StagingArea) -> None:
    staging.create()
    staging.write_requests([request(f"q{i:03d}", i) for i in range(0, 150)])
    staging.write_requests([request(f"q{i:03d}", i) for i in range(150, 200)])
    staging.write_rows("results", [result_row(f"q{i:03d}") for i in range(0, 200, 3)])
    staging.write_rows("errors", [error_row(7, "q007", "engine_error")])
    staging.write_rows("errors", [error_row(8, "q008")], prefix="validate")  # ingest's: not an engine's row


def _ids(staging: StagingArea, files: list[str]) -> list[str]:
    return sorted(
        i for f in files for i in staging.read_part(f, ["custom_id"]).column("custom_id").to_pylist()
    )


def _expected() -> list[str]:
    return [f"q{i:03d}" for i in range(200) if i % 3 and i != 7]


@pytest.fixture
def join_on_the_cluster(monkeypatch):
    """Even these 200 requests go through the cluster's anti-join, not the small-job path."""
    monkeypatch.setattr(pending, "DRIVER_FILTER_ROWS", 0)


def test_local_staging(tmp_path: Path, join_on_the_cluster):
    staging = output_target(str(tmp_path / "out"), StorageConfig()).staging_area()
    _staged_job(staging)
    work = pending_work(staging, 200)
    assert work.finished_rows == 68
    assert all(f.startswith(staging.pending_dir) for f in work.files)
    assert _ids(staging, work.files) == _expected()
    again = pending_work(staging, 200)  # a later resume replaces the earlier list
    assert _ids(staging, again.files) == _expected() and not set(again.files) & set(work.files)


def test_s3_staging(moto_s3, tmp_path: Path, monkeypatch, join_on_the_cluster):
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path / "home"))
    storage = StorageConfig(s3_endpoint_url=moto_s3.url, **FAST_RETRIES)
    bucket = moto_s3.bucket("pending")
    staging = output_target(f"s3://{bucket}/job", storage).staging_area()
    _staged_job(staging)
    work = pending_work(staging, 200)
    assert work.finished_rows == 68
    assert all(f.startswith(f"{bucket}/job/_staging/pending/") for f in work.files)
    assert _ids(staging, work.files) == _expected()


def test_a_small_job_is_filtered_by_the_driver_with_the_same_result(tmp_path: Path, monkeypatch):
    staging = output_target(str(tmp_path / "out"), StorageConfig()).staging_area()
    _staged_job(staging)
    monkeypatch.setattr(pending, "_anti_join", lambda *a: pytest.fail("a small job ran the cluster's join"))
    work = pending_work(staging, 200)
    assert work.finished_rows == 68 and all(f.startswith(staging.pending_dir) for f in work.files)
    assert _ids(staging, work.files) == _expected()


def test_a_fresh_job_runs_its_work_list_as_it_is(tmp_path: Path):
    staging = output_target(str(tmp_path / "out"), StorageConfig()).staging_area()
    staging.create()
    staging.write_requests([request(f"q{i}", i) for i in range(5)])
    work = pending_work(staging, 5)
    assert work.files == staging.request_files() and work.finished_rows == 0


def test_nothing_left(tmp_path: Path):
    staging = output_target(str(tmp_path / "out"), StorageConfig()).staging_area()
    staging.create()
    staging.write_requests([request(f"q{i}", i) for i in range(3)])
    staging.write_rows("results", [result_row(f"q{i}") for i in range(3)])
    assert pending_work(staging, 3) == PendingWork([], 3)
