"""`nightshift status` of an s3:// OUTPUT (moto's S3 server on loopback): an unfinished job read from the bucket's
staging, then the same job once its manifest is there. No Ray."""

# ruff: noqa: F811 - pytest fixtures imported from storage_fixtures are re-bound as test arguments
from __future__ import annotations

import json
import time

from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import JobConfig, StorageConfig
from pipeline.io.staging import StagedRow
from pipeline.io.writers import output_target
from pipeline.observe.status import job_status
from pipeline.observe.timeline import Timeline
from pipeline.state import JobInput, JobState
from tests.integration.storage_fixtures import moto_s3  # noqa: F401


def test_status_of_an_s3_output(moto_s3, tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path / "home"))
    storage = StorageConfig(s3_endpoint_url=moto_s3.url, retries=2, retry_backoff_s=0.01)
    url = f"s3://{moto_s3.bucket('status')}/jobs/one"
    target = output_target(url, storage)
    staging = target.staging_area()
    state = JobState(job_id="s3job", config=JobConfig(), ingested=True)
    state.input = JobInput(fingerprint="f", lines=6, valid=5, invalid=1)
    staging.write_job(state)
    staging.write_rows(
        "results", [StagedRow(f"r{i}", i, "in", None, 2, 3, "default", "{}") for i in range(3)]
    )
    staging.write_rows("errors", [StagedRow(None, 6, "in", "invalid_json", 0, 0, "", "{}")])
    timeline = Timeline(runs=[time.time() - 30], updated_at=time.time() - 600)  # its driver is long gone
    staging.files.write_bytes(f"{staging.root}/timeline.json", timeline.to_json())

    status = job_status(url, storage)
    assert status["state"] == "interrupted"
    assert status["rows"] == {"total": 6, "done": 4, "failed": 1}
    assert status["errors_by_code"] == {"invalid_json": 1}

    manifest = {
        "job_id": "s3job",
        "counts": {"total": 6, "succeeded": 5, "failed": 1, "by_error_code": {"invalid_json": 1}},
        "tokens": {"prompt": 10, "completion": 15},
        "throughput": {"output_tokens_per_s": 1.5, "rows_per_s": 0.6},
        "wall_time_s": 10.0,
        "pools": {"default": {"rows": 5, "completion_tokens": 15, "engines": 1}},
    }
    target.put_bytes("manifest.json", json.dumps(manifest).encode())
    shown = CliRunner().invoke(app, ["status", url, "--json", "--s3-endpoint-url", moto_s3.url])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["state"] == "finished"
