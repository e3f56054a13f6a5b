"""Failures during a job: a poison request, a killed driver followed by `resume` (local output; S3 output resumed
from another machine). Each asserts exactly-once output and full accounting. (Node loss: test_node_loss.py; a killed
real engine: tests/e2e/test_engine_killed.py.) Each test names the README "Failure model" row it covers."""

# ruff: noqa: F811 - pytest fixtures imported from storage_fixtures are re-bound as test arguments

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import JobConfig
from pipeline.manifest import Manifest
from pipeline.runtime.job import run_job
from tests.failure_figures import record
from tests.integration.storage_fixtures import moto_s3  # noqa: F401
from tests.lines import chat_line, read_jsonl, write_lines
from tests.runs import (
    assert_same_shards,
    held_until_half_staged,
    kill_driver_half_way,
    nightshift_ok,
    once_settled,
    run_command,
    run_uninterrupted,
)


def fake_job(input_path, output, **fake_args) -> JobConfig:
    return JobConfig.model_validate(
        {
            "input": str(input_path),
            "output": str(output),
            "engine": {"backend": "fake", "fake": {"output_tokens": 4, **fake_args}},
            "resources": {"num_engines": 1, "cpus_per_engine": 0.5, "rows_per_task": 8},
            "output_options": {"rows_per_shard": 100, "staging_rows": 50},
        }
    )


def check_exactly_once(output: Path, expected_lines: int) -> tuple[list[dict], list[dict]]:
    results = read_jsonl(output.glob("results-*.jsonl"))
    errors = read_jsonl(output.glob("errors-*.jsonl"))
    assert len(results) + len(errors) == expected_lines  # accounting
    ids = [r["custom_id"] for r in results + errors if r["custom_id"] is not None]
    assert len(ids) == len(set(ids))  # no row duplicated
    return results, errors


@pytest.mark.usefixtures("local_ray")
def test_poison_request_is_isolated_and_the_job_finishes(tmp_path):
    """README "Failure model", row "a request that kills its engine every time"."""
    lines = [chat_line(f"row-{i:03d}", f"question {i}") for i in range(60)]
    lines[17] = chat_line("row-017-POISON", "this request kills the engine")
    path = write_lines(tmp_path / "in.jsonl", lines)
    calls = tmp_path / "calls.log"
    outcome = run_job(
        fake_job(path, tmp_path / "out", crash_on=["POISON"], call_log=str(calls)), show_progress=False
    )

    crashes = calls.read_text().split().count("row-017-POISON")
    output = read_jsonl(outcome.output.glob("*-of-*.jsonl"))
    record(
        "poison request (crashes its engine every time)",
        injected=crashes,
        input_lines=60,
        output_ids=[r["custom_id"] for r in output],
    )
    results, errors = check_exactly_once(outcome.output, 60)
    assert len(results) == 59
    (poison,) = errors
    assert poison["custom_id"] == "row-017-POISON"
    assert poison["response"]["status_code"] == 500
    assert poison["response"]["body"]["error"]["code"] == "engine_error"
    # Bounded: twice in company, once alone, then isolated — never a fourth crash.
    assert calls.read_text().split().count("row-017-POISON") == 3
    assert outcome.manifest["counts"]["by_error_code"] == {"engine_error": 1}
    assert outcome.manifest["recovery"]["requests_retried_after_engine_failure"] >= 1


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
def test_driver_killed_half_way_then_resume(tmp_path):
    """README "Failure model", row "the driver is killed (SSH drop, `kill -9`)"."""
    n = 3000
    lines = [chat_line(f"id-{(i * 7919) % n:05d}", f"question {i}") for i in range(n)]
    lines[5] = "{not json"  # an error record must survive the crash too
    path = write_lines(tmp_path / "in.jsonl", lines)
    calls = tmp_path / "calls.log"
    config = tmp_path / "job.yaml"
    config.write_text(
        json.dumps(
            {
                "job_id": "resume-test",
                "engine": {
                    "backend": "fake",
                    "fake": {
                        "output_tokens": 4,
                        "decode_seconds_per_token": 0.05,
                        "max_concurrency": 64,
                        "call_log": str(calls),
                        "hold_while": str(tmp_path / "hold"),
                    },
                },
                "resources": {"cpus_per_engine": 0.5, "rows_per_task": 16},
                "output_options": {"rows_per_shard": 700, "staging_rows": 100},
            }
        )
    )
    output = tmp_path / "out"
    cmd = run_command(path, output, config)
    staged_before = kill_driver_half_way(cmd, output, n, hold=tmp_path / "hold")
    assert not (output / "manifest.json").exists()
    calls_before = len(calls.read_text().split())
    assert n // 2 <= len(staged_before) < n

    nightshift_ok("resume", str(output), "--no-progress")
    recomputed = set(calls.read_text().split()[calls_before:]) & staged_before
    record(
        "driver SIGKILLed half way, then `resume`",
        injected=1,
        input_lines=n,
        output_ids=[r["custom_id"] for r in read_jsonl(output.glob("*-of-*.jsonl"))],
        finished_before=len(staged_before),
        recomputed=len(recomputed),
    )
    check_exactly_once(output, n)
    assert recomputed == set(), f"{len(recomputed)} staged rows were run again"
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["recovery"]["resumed"] is True
    assert manifest["recovery"]["rows_from_earlier_runs"] == len(staged_before)
    # Built from the job state read back from staging: still a complete manifest.
    assert Manifest.model_validate(manifest).model_dump(mode="json") == manifest

    # The same job uninterrupted (same job id → same output ids): byte-identical shards.
    clean = tmp_path / "clean"
    run_uninterrupted(path, clean, config)
    assert_same_shards(clean, output)


def test_resume_refuses_a_changed_input(tmp_path):
    """README "Failure model", row "the input changes before resume"."""
    path = write_lines(tmp_path / "in.jsonl", [chat_line("a", "x")])
    output = tmp_path / "out"
    staging = output / "_staging"
    staging.mkdir(parents=True)
    (staging / "job.json").write_text(
        json.dumps(
            {
                "job_id": "j1",
                "ingested": True,
                "config": fake_job(path, output).model_dump(mode="json"),
                "input": {"fingerprint": "sha256:" + "0" * 64, "lines": 1, "valid": 1, "invalid": 0},
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "resume", str(output)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "changed since the job started" in proc.stderr
    assert os.listdir(staging) == ["job.json"]  # nothing done


def test_run_into_unfinished_output_points_at_resume(tmp_path):
    path = write_lines(tmp_path / "in.jsonl", [chat_line("a", "x")])
    (tmp_path / "out" / "_staging").mkdir(parents=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", str(path), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "nightshift resume" in proc.stderr and "--resume" in proc.stderr


def _staged_ids_s3(moto_s3, bucket: str, prefix: str) -> set[str]:
    ids: set[str] = set()
    staging = f"{prefix}/_staging/"
    for key in moto_s3.keys(bucket, staging):
        # The engines' parts only: `results/<part>` and `errors/<part>` right under _staging/, not the Arrow files
        # of a finalize that began before the kill landed (`finalize/keys/results/...`).
        kind, _, name = key[len(staging) :].partition("/")
        if kind in ("results", "errors") and "/" not in name and not name.startswith("validate-"):
            ids.update(_read_staged_part(moto_s3, bucket, key))
    return ids


def _read_staged_part(moto_s3, bucket: str, key: str, tries: int = 20) -> list[str]:
    """The part's ids. The local S3 stand-in (moto) can serve an object while its PUT is still arriving — a dying
    driver's engines may still be staging — which real S3 never does; such a read is tried again."""
    for attempt in range(tries):
        try:
            table = pq.read_table(io.BytesIO(moto_s3.get(bucket, key)), columns=["custom_id"])
            return table.column("custom_id").to_pylist()
        except pa.ArrowInvalid:
            if attempt == tries - 1:
                raise
            time.sleep(0.25)
    raise AssertionError("unreachable")


def _machine(tmp_path: Path, name: str) -> dict[str, str]:
    """The environment of another machine: its own NIGHTSHIFT_HOME (sharing only the prepared model)."""
    from pipeline.local_files import nightshift_home
    from pipeline.models import prepare_embedded_model

    prepare_embedded_model()
    home = tmp_path / name
    home.mkdir()
    (home / "models").symlink_to(nightshift_home() / "models")
    return {**os.environ, "NIGHTSHIFT_HOME": str(home)}


@pytest.mark.slow
def test_s3_driver_killed_half_way_then_resumed_on_another_machine(moto_s3, tmp_path):
    """README "Failure model", row "the driver's machine is lost, the OUTPUT is `s3://…`"."""
    n = 2000
    lines = [chat_line(f"id-{(i * 7919) % n:05d}", f"question {i}") for i in range(n)]
    lines[5] = "{not json"
    bucket = moto_s3.bucket("resume")
    moto_s3.put(bucket, "in/batch.jsonl", "".join(line + "\n" for line in lines).encode())
    output = f"s3://{bucket}/out"
    calls = tmp_path / "calls.log"
    config = tmp_path / "job.yaml"
    config.write_text(
        json.dumps(
            {
                "job_id": "s3-resume-test",
                "engine": {
                    "backend": "fake",
                    "fake": {
                        "output_tokens": 4,
                        "decode_seconds_per_token": 0.05,
                        "max_concurrency": 64,
                        "call_log": str(calls),
                        "hold_while": str(tmp_path / "hold"),
                    },
                },
                "resources": {"cpus_per_engine": 0.5, "rows_per_task": 16},
                "output_options": {"rows_per_shard": 700, "staging_rows": 100},
            }
        )
    )
    machine_a, machine_b = _machine(tmp_path, "home-a"), _machine(tmp_path, "home-b")
    endpoint = ["--s3-endpoint-url", moto_s3.url]
    run = [
        sys.executable,
        "-m",
        "pipeline",
        "run",
        f"s3://{bucket}/in/batch.jsonl",
        output,
        "-c",
        str(config),
    ]
    driver = subprocess.Popen(
        [*run, *endpoint, "--no-progress"],
        env=machine_a,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    held_until_half_staged(driver, lambda: _staged_ids_s3(moto_s3, bucket, "out"), n, tmp_path / "hold")
    driver.send_signal(signal.SIGKILL)
    driver.wait()

    # The checkpoint is in the bucket, not on machine A's disk.
    staged_keys = moto_s3.keys(bucket, "out/_staging/")
    assert "out/_staging/job.json" in staged_keys
    assert any(k.startswith("out/_staging/requests/") for k in staged_keys)
    assert "out/manifest.json" not in moto_s3.keys(bucket)
    assert not [p for p in Path(machine_a["NIGHTSHIFT_HOME"]).rglob("job.json")]
    staged_before = once_settled(lambda: _staged_ids_s3(moto_s3, bucket, "out"))
    (tmp_path / "hold").unlink()
    calls_before = len(calls.read_text().split())
    assert n // 2 <= len(staged_before) < n

    resumed = subprocess.run(
        [sys.executable, "-m", "pipeline", "resume", output, *endpoint, "--no-progress"],
        env=machine_b,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    keys = moto_s3.keys(bucket, "out/")
    assert not [k for k in keys if k.startswith("out/_staging/")]  # the checkpoint is gone after the commit
    results, errors = [], []
    for key in keys:
        rows = (
            [json.loads(line) for line in moto_s3.get(bucket, key).splitlines()]
            if key.endswith(".jsonl")
            else []
        )
        (results if "/results-" in key else errors).extend(rows)
    recomputed = set(calls.read_text().split()[calls_before:]) & staged_before
    record(
        "driver SIGKILLed, S3 output resumed on another machine",
        injected=1,
        input_lines=n,
        output_ids=[r["custom_id"] for r in results + errors],
        finished_before=len(staged_before),
        recomputed=len(recomputed),
    )
    assert len(results) + len(errors) == n  # accounting
    ids = [r["custom_id"] for r in results + errors if r["custom_id"] is not None]
    assert len(ids) == len(set(ids))  # no row twice
    assert len(errors) == 1 and errors[0]["error"]["code"] == "invalid_json"
    recomputed = set(calls.read_text().split()[calls_before:]) & staged_before
    assert recomputed == set(), f"{len(recomputed)} staged rows were run again"
    manifest = json.loads(moto_s3.get(bucket, "out/manifest.json"))
    assert manifest["recovery"]["resumed"] is True
    assert manifest["recovery"]["rows_from_earlier_runs"] == len(staged_before)
    assert manifest["counts"] == {
        "total": n,
        "succeeded": n - 1,
        "failed": 1,
        "by_error_code": {"invalid_json": 1},
        "structured": {"requested": 0, "parsed_json": 0},
    }
    assert not (Path(machine_b["NIGHTSHIFT_HOME"]) / "jobs").exists() or not any(
        (Path(machine_b["NIGHTSHIFT_HOME"]) / "jobs").iterdir()
    )  # machine B's scratch (read cache, spills, upload spools) is gone too


# The driver of `nightshift run`, killed during finalize: once three shards are written and recorded.
_KILLED_DURING_FINALIZE = """
import os, signal
from pipeline.runtime.commit import finalize

from pipeline.runtime.hosting.executor import TaskExecutor

real_map = TaskExecutor.map

def map(self, fn, context, items, *args, **kwargs):
    if fn is finalize._reduce_task and len(items) > 3:
        real_map(self, fn, context, items[:3], *args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
    return real_map(self, fn, context, items, *args, **kwargs)

TaskExecutor.map = map
from pipeline.cli import app
app(prog_name="nightshift")
"""


@pytest.mark.slow
def test_driver_killed_during_finalize_then_resume(tmp_path):
    """README "Failure model", row "the driver is killed (SSH drop, `kill -9`)" — during finalize: `resume` keeps
    the shards already written and writes only the others."""
    n = 600
    lines = [chat_line(f"id-{(i * 7919) % n:05d}", f"question {i}") for i in range(n)]
    lines[9] = "{not json"
    path = write_lines(tmp_path / "in.jsonl", lines)
    config = tmp_path / "job.yaml"
    config.write_text(
        json.dumps(
            {
                "job_id": "finalize-kill",
                "engine": {"backend": "fake", "fake": {"output_tokens": 4}},
                "output_options": {"rows_per_shard": 50, "staging_rows": 100},
            }
        )
    )
    output = tmp_path / "out"
    args = ["run", str(path), str(output), "-c", str(config), "--no-progress"]
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_DURING_FINALIZE, *args], capture_output=True, text=True, timeout=600
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (output / "manifest.json").exists()
    written = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in output.glob("results-*")}
    assert len(written) == 3

    resumed = subprocess.run(
        [sys.executable, "-m", "pipeline", "resume", str(output), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for name, stamp in written.items():  # not written again
        assert ((output / name).stat().st_ino, (output / name).stat().st_mtime_ns) == stamp, name
    manifest = json.loads((output / "manifest.json").read_text())
    assert [s["rows"] for s in manifest["shards"]["results"]] == [50] * 11 + [49]
    check_exactly_once(output, n)

    clean = tmp_path / "clean"
    uninterrupted = subprocess.run(
        [sys.executable, "-m", "pipeline", *args[:2], str(clean), *args[3:]],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    names = sorted(p.name for p in clean.glob("*-of-*.jsonl"))
    assert names == sorted(p.name for p in output.glob("*-of-*.jsonl"))
    for name in names:
        assert (clean / name).read_bytes() == (output / name).read_bytes(), name
