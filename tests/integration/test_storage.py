"""The data plane end to end on real local Ray with the fake engine: S3 (a moto server on loopback) and HTTP
inputs and outputs, JSONL and Parquet both ways, shards from directories and globs, retried transient errors, and
bad locations that fail before any engine starts."""

# ruff: noqa: F811 - pytest fixtures imported from storage_fixtures are re-bound as test arguments

from __future__ import annotations

import gzip
import hashlib
import io
import json
import random
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import JobConfig, StorageConfig
from pipeline.io.readers import input_source
from pipeline.io.rows import ReadStats
from pipeline.io.writers import local_job_dir
from pipeline.runtime.job import run_job
from pipeline.runtime.preflight import PreflightError
from tests.integration.storage_fixtures import free_port, http_files, http_server, moto_s3  # noqa: F401
from tests.lines import MODEL_NAME, chat_line, completion_line

pytestmark = pytest.mark.usefixtures("local_ray")

FAST_RETRIES = {"retries": 3, "retry_backoff_s": 0.02, "retry_backoff_max_s": 0.1, "timeout_s": 10}


def _job(input_location: str, output_location: str, storage: dict | None = None, **overrides) -> JobConfig:
    config = {
        "input": input_location,
        "output": output_location,
        "model": None,
        "engine": {"backend": "fake", "fake": {"output_tokens": 3}},
        "resources": {"num_engines": 1, "cpus_per_engine": 0.5, "rows_per_task": 256},
        "output_options": {"rows_per_shard": 5000, "staging_rows": 2000},
        "storage": {**FAST_RETRIES, **(storage or {})},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return JobConfig.model_validate(config)


def _lines(n: int, seed: int, bad_every: int = 0) -> tuple[list[str], list[str]]:
    """n requests in shuffled id order (+ a broken line every `bad_every`); returns (lines, valid ids)."""
    rng = random.Random(seed)
    ids = [f"req-{seed}-{i:06d}" for i in range(n)]
    rng.shuffle(ids)
    lines = []
    for k, custom_id in enumerate(ids):
        maker = completion_line if k % 4 == 0 else chat_line
        lines.append(maker(custom_id, f"question {k} about {custom_id}"))
        if bad_every and k % bad_every == 0:
            lines.append('{"custom_id": "broken", ')
    return lines, ids


def _jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def _check_jsonl_shards(files: dict[str, bytes], manifest: dict, expected_ids: list[str]) -> list[dict]:
    """Shards match the manifest (rows, sha256) and hold the sorted ids; returns the error records."""
    seen = []
    for shard in manifest["shards"]["results"]:
        data = files[shard["name"]]
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        ids = [json.loads(line)["custom_id"] for line in data.splitlines()]
        assert len(ids) == shard["rows"] and (ids[0], ids[-1]) == (
            shard["first_custom_id"],
            shard["last_custom_id"],
        )
        seen.extend(ids)
    assert seen == sorted(expected_ids)
    errors = []
    for shard in manifest["shards"]["errors"]:
        data = files[shard["name"]]
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        errors.extend(json.loads(line) for line in data.splitlines())
    return errors


# -- S3 → S3 --------------------------------------------------------------------------------------------------------


def test_s3_to_s3_jsonl_large_input(moto_s3):
    bucket_in, bucket_out = moto_s3.bucket("in"), moto_s3.bucket("out")
    lines, ids = _lines(12_000, seed=1, bad_every=3000)
    chunk = len(lines) // 3
    for k in range(3):  # three shards under a prefix, plus files that are not input
        moto_s3.put(
            bucket_in, f"batch/part-{k}.jsonl", _jsonl(lines[k * chunk : (k + 1) * chunk if k < 2 else None])
        )
    moto_s3.put(bucket_in, "batch/README.txt", b"not an input")
    moto_s3.put(bucket_in, "batch/_SUCCESS", b"")
    output = f"s3://{bucket_out}/runs/one"

    outcome = run_job(
        _job(f"s3://{bucket_in}/batch", output, storage={"s3_endpoint_url": moto_s3.url}), show_progress=False
    )

    keys = moto_s3.keys(bucket_out)
    names = [k.rsplit("/", 1)[-1] for k in keys]
    assert sorted(names) == sorted(
        [f"results-{k:05d}-of-00003.jsonl" for k in range(3)]
        + ["errors-00000-of-00001.jsonl", "manifest.json", "report.html"]
    )
    manifest = json.loads(moto_s3.get(bucket_out, "runs/one/manifest.json"))
    assert manifest == outcome.manifest
    files = {n: moto_s3.get(bucket_out, f"runs/one/{n}") for n in names}
    errors = _check_jsonl_shards(files, manifest, ids)
    assert manifest["counts"]["total"] == len(lines) == 12_004
    assert [e["error"]["code"] for e in errors] == ["invalid_json"] * 4
    assert {e["error"]["source"] for e in errors} <= {
        f"s3://{bucket_in}/batch/part-{k}.jsonl" for k in range(3)
    }
    assert manifest["input"]["location"] == f"s3://{bucket_in}/batch"
    assert manifest["input"]["fingerprint"].startswith("s3:")
    assert manifest["input"]["size_bytes"] == sum(
        len(_jsonl(lines[k * chunk : (k + 1) * chunk if k < 2 else None])) for k in range(3)
    )
    assert outcome.output == output
    assert not [
        k for k in keys if "/_staging/" in k
    ]  # the checkpoint (in the bucket) dropped after the commit
    assert not local_job_dir(output).exists()  # and the local scratch (spools, spills, read cache) too


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def test_s3_to_s3_parquet_struct_and_string_bodies(moto_s3):
    bucket = moto_s3.bucket("pq")
    rng = random.Random(5)
    ids = [f"p-{i:05d}" for i in range(3000)]
    rng.shuffle(ids)
    struct_rows = [
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/chat/completions",
            # Only some rows set temperature: the struct column gives the others a null, which must not reach
            # the request as "temperature": null.
            "body": {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": f"hi {cid}"}],
                "max_tokens": 2,
            }
            | ({"temperature": 0.5} if i % 2 else {}),
        }
        for i, cid in enumerate(ids[:1500])
    ]
    string_rows = [
        {
            "custom_id": cid,
            "url": "/v1/completions",  # no `method` column in this file
            "body": json.dumps({"model": MODEL_NAME, "prompt": f"once {cid}", "max_tokens": 2}),
        }
        for cid in ids[1500:]
    ]
    string_rows.append({"custom_id": "bad-body", "url": "/v1/completions", "body": "{not json"})
    moto_s3.put(bucket, "in/a-struct.parquet", _parquet_bytes(pa.Table.from_pylist(struct_rows)))
    moto_s3.put(bucket, "in/b-string.parquet", _parquet_bytes(pa.Table.from_pylist(string_rows)))
    output = f"s3://{bucket}/out/"

    run_job(
        _job(
            f"s3://{bucket}/in/",
            output,
            storage={"s3_endpoint_url": moto_s3.url},
            output_options={"format": "parquet", "rows_per_shard": 1000},
        ),
        show_progress=False,
    )

    manifest = json.loads(moto_s3.get(bucket, "out/manifest.json"))
    assert [s["name"] for s in manifest["shards"]["results"]] == [
        f"results-{k:05d}-of-00003.parquet" for k in range(3)
    ]
    results = []
    for shard in manifest["shards"]["results"]:
        data = moto_s3.get(bucket, f"out/{shard['name']}")
        assert hashlib.sha256(data).hexdigest() == shard["sha256"] and len(data) == shard["bytes"]
        table = pq.read_table(io.BytesIO(data))
        assert table.num_rows == shard["rows"]
        results.extend(table.to_pylist())
    assert table.schema.names == [
        "id", "custom_id", "status_code", "response", "error", "route", "content", "finish_reason",
        "prompt_tokens", "completion_tokens", "embeddings", "scores", "ranking", "queue_wait_s", "engine_s",
    ]  # fmt: skip
    assert [r["custom_id"] for r in results] == sorted(ids)
    assert all(r["status_code"] == 200 and r["error"] is None for r in results)
    assert all(
        r["content"] and r["finish_reason"] == "length" and r["completion_tokens"] == 2 for r in results
    )
    body = json.loads(results[0]["response"])["body"]
    assert (
        body["choices"][0].get("message", {}).get("content", body["choices"][0].get("text"))
        == results[0]["content"]
    )

    (error_shard,) = manifest["shards"]["errors"]
    errors = pq.read_table(io.BytesIO(moto_s3.get(bucket, f"out/{error_shard['name']}"))).to_pylist()
    assert len(errors) == 1 and errors[0]["custom_id"] == "bad-body" and errors[0]["response"] is None
    error = json.loads(errors[0]["error"])
    assert error["code"] == "invalid_json" and error["line"] == 1501
    assert error["source"] == f"s3://{bucket}/in/b-string.parquet"


# -- local shards → local Parquet ------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["directory", "glob"])
def test_local_shards_to_local_parquet(tmp_path: Path, how: str):
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    lines, ids = _lines(900, seed=3)
    (shards / "a.jsonl").write_bytes(_jsonl(lines[:300]))
    (shards / "sub" / "b.jsonl").write_bytes(_jsonl(lines[300:600]))
    rest = [json.loads(line) for line in lines[600:]]
    for row in rest:
        row["body"] = json.dumps(row["body"])
    pq.write_table(pa.Table.from_pylist(rest), shards / "c.parquet")
    (shards / "notes.md").write_text("ignored")
    location = str(shards) if how == "directory" else str(shards / "**" / "*.*")
    if how == "glob":
        (shards / "notes.md").unlink()
    output = tmp_path / "out"

    outcome = run_job(
        _job(location, str(output), output_options={"format": "parquet", "rows_per_shard": 400}),
        show_progress=False,
    )

    names = sorted(p.name for p in output.iterdir())
    assert names == ["errors-00000-of-00001.parquet", "manifest.json", "report.html"] + [
        f"results-{k:05d}-of-00003.parquet" for k in range(3)
    ]
    table = pa.concat_tables(pq.read_table(output / f"results-{k:05d}-of-00003.parquet") for k in range(3))
    assert table.column("custom_id").to_pylist() == sorted(ids)
    assert pq.read_table(output / "errors-00000-of-00001.parquet").num_rows == 0
    for shard in outcome.manifest["shards"]["results"]:
        assert hashlib.sha256((output / shard["name"]).read_bytes()).hexdigest() == shard["sha256"]
    assert outcome.manifest["input"]["fingerprint"].startswith("sha256:")
    assert outcome.manifest["input"]["size_bytes"] == sum(
        p.stat().st_size for p in shards.rglob("*.*") if p.suffix in (".jsonl", ".parquet")
    )


# -- HTTP → HTTP ----------------------------------------------------------------------------------------------------


def test_http_get_input_to_http_put_output_with_transient_failures(http_files):
    lines, ids = _lines(2000, seed=4, bad_every=700)
    (http_files.root / "batch.jsonl").write_bytes(_jsonl(lines))
    http_files.fail_next(2, methods=("HEAD", "GET"))  # preflight and the download each see a 503 or two
    http_files.truncate_next(1)  # one download breaks off halfway
    http_files.fail_next(2, methods=("PUT",))
    output = f"{http_files.url}/results/run-1?token=abc"

    outcome = run_job(_job(f"{http_files.url}/batch.jsonl", output), show_progress=False)

    out_dir = http_files.uploads / "results" / "run-1"
    files = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    assert set(files) == {
        "results-00000-of-00001.jsonl",
        "errors-00000-of-00001.jsonl",
        "manifest.json",
        "report.html",
    }
    manifest = json.loads(files["manifest.json"])
    errors = _check_jsonl_shards(files, manifest, ids)
    assert [e["error"]["code"] for e in errors] == ["invalid_json"] * 3
    assert manifest["counts"]["total"] == len(lines)
    puts = [(path, status) for method, path, status in http_files.log if method == "PUT"]
    assert puts[-1][0].startswith("/results/run-1/manifest.json") and puts[-1][1] == 201  # the manifest last
    assert all("token=abc" in path for path, _ in puts)  # the query string rides on every object URL
    assert sum(1 for _, status in puts if status == 503) == 2
    retries = manifest["storage"]
    assert retries["retries"] >= 5 and retries["by_operation"]["PUT"] == 2
    assert "token" not in manifest["input"]["location"] and "token" not in str(outcome.output)
    assert manifest["input"]["fingerprint"].startswith("http:")  # from ETag / Last-Modified


def test_http_input_without_validators_is_fingerprinted_by_content(http_files, tmp_path: Path):
    lines, ids = _lines(50, seed=6)
    data = _jsonl(lines)
    (http_files.root / "plain.jsonl").write_bytes(data)
    http_files.etag = False
    outcome = run_job(_job(f"{http_files.url}/plain.jsonl", str(tmp_path / "out")), show_progress=False)
    assert outcome.manifest["input"]["fingerprint"] == "sha256:" + hashlib.sha256(data).hexdigest()
    assert outcome.manifest["counts"]["succeeded"] == 50


# -- bad locations fail before any engine starts ---------------------------------------------------------------------


def _bad_location_cases(s3, http, tmp_path: Path):
    good_bucket = s3.bucket("ok")
    s3.put(good_bucket, "in/batch.jsonl", _jsonl(_lines(5, seed=9)[0]))
    s3.put(good_bucket, "done/manifest.json", b"{}")
    (http.uploads / "done").mkdir(exist_ok=True)
    (http.uploads / "done" / "manifest.json").write_text("{}")
    (http.root / "batch.jsonl").write_bytes(_jsonl(_lines(5, seed=9)[0]))
    pq.write_table(pa.table({"id": ["a"], "text": ["b"]}), tmp_path / "wrong.parquet")
    s3_in = f"s3://{good_bucket}/in/"
    dead = f"http://127.0.0.1:{free_port()}"
    return {
        "input-bucket-missing": ("s3://no-such-bucket-here/in/", str(tmp_path / "o"), "does not exist"),
        "output-bucket-missing": (s3_in, "s3://no-such-bucket-here/out", "does not exist"),
        "input-prefix-empty": (f"s3://{good_bucket}/nothing/", str(tmp_path / "o"), "no input files"),
        "output-holds-completed-job": (s3_in, f"s3://{good_bucket}/done", "already holds a completed job"),
        "s3-endpoint-unreachable": (s3_in, str(tmp_path / "o"), "unreachable"),
        "http-input-unreachable": (f"{dead}/batch.jsonl", str(tmp_path / "o"), "unreachable"),
        "http-input-404": (f"{http.url}/missing.jsonl", str(tmp_path / "o"), "not found (HTTP 404)"),
        "http-output-unreachable": (s3_in, f"{dead}/out", "unreachable"),
        "http-output-holds-completed-job": (s3_in, f"{http.url}/done", "already holds a completed job"),
        "local-input-missing": (str(tmp_path / "nope.jsonl"), str(tmp_path / "o"), "does not exist"),
        "parquet-without-request-columns": (
            str(tmp_path / "wrong.parquet"),
            str(tmp_path / "o"),
            "has no column",
        ),
    }


CASES = [
    "input-bucket-missing",
    "output-bucket-missing",
    "input-prefix-empty",
    "output-holds-completed-job",
    "s3-endpoint-unreachable",
    "http-input-unreachable",
    "http-input-404",
    "http-output-unreachable",
    "http-output-holds-completed-job",
    "local-input-missing",
    "parquet-without-request-columns",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_location_fails_before_engines_start(case, moto_s3, http_files, tmp_path: Path):
    input_location, output_location, message = _bad_location_cases(moto_s3, http_files, tmp_path)[case]
    endpoint = f"http://127.0.0.1:{free_port()}" if case == "s3-endpoint-unreachable" else moto_s3.url
    call_log = tmp_path / "engine-calls.log"
    config = _job(
        input_location,
        output_location,
        storage={"s3_endpoint_url": endpoint, "retries": 2},
        engine={"backend": "fake", "fake": {"call_log": str(call_log)}},
    )
    started = time.monotonic()
    with pytest.raises(PreflightError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_job(config, show_progress=False)
    assert time.monotonic() - started < 15
    assert not call_log.exists()  # no engine ran a request
    if not output_location.startswith(("s3://", "http")):
        assert not (Path(output_location) / "_staging").exists()


@pytest.mark.parametrize("side", ["input", "output"])
def test_denied_credentials_fail_before_engines_start(side, moto_s3, tmp_path: Path, monkeypatch):
    bucket = moto_s3.bucket("deny")
    moto_s3.put(bucket, "in/batch.jsonl", _jsonl(_lines(5, seed=10)[0]))
    local_in = tmp_path / "in.jsonl"
    local_in.write_bytes(_jsonl(_lines(5, seed=10)[0]))
    input_location = f"s3://{bucket}/in/" if side == "input" else str(local_in)
    output_location = str(tmp_path / "o") if side == "input" else f"s3://{bucket}/out/"
    call_log = tmp_path / "engine-calls.log"
    config = _job(
        input_location,
        output_location,
        storage={"s3_endpoint_url": moto_s3.url},
        engine={"backend": "fake", "fake": {"call_log": str(call_log)}},
    )
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAREALKEY00000")
    moto_s3.enforce_auth(True)
    try:
        with pytest.raises(PreflightError, match="access denied") as info:
            run_job(config, show_progress=False)
    finally:
        moto_s3.enforce_auth(False)
    assert "AWS_ACCESS_KEY_ID" in str(info.value)  # says what to change
    assert not call_log.exists()


def test_unfinished_s3_job_is_refused_with_its_staging_in_the_bucket(moto_s3, tmp_path: Path):
    bucket = moto_s3.bucket("stg")
    local_in = tmp_path / "in.jsonl"
    local_in.write_bytes(_jsonl(_lines(5, seed=11)[0]))
    output = f"s3://{bucket}/out"
    moto_s3.put(bucket, "out/_staging/job.json", b"{}")
    with pytest.raises(PreflightError, match="unfinished job") as info:
        run_job(_job(str(local_in), output, storage={"s3_endpoint_url": moto_s3.url}), show_progress=False)
    assert f"{output}/_staging" in str(info.value) and f"nightshift resume {output}" in str(info.value)
    assert moto_s3.keys(bucket) == ["out/_staging/job.json"]  # nothing touched


def test_unfinished_http_job_is_refused_with_its_local_staging(http_files, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path / "home"))
    local_in = tmp_path / "in.jsonl"
    local_in.write_bytes(_jsonl(_lines(5, seed=11)[0]))
    output = f"{http_files.url}/unfinished"
    staging = local_job_dir(output) / "_staging"
    staging.mkdir(parents=True)
    with pytest.raises(PreflightError, match="unfinished job") as info:
        run_job(_job(str(local_in), output), show_progress=False)
    assert f"staged locally in {staging}" in str(info.value) and f"nightshift resume {output}" in str(
        info.value
    )


def test_overwrite_replaces_a_remote_output_without_stale_shards(moto_s3, tmp_path: Path):
    bucket = moto_s3.bucket("ovw")
    local_in = tmp_path / "in.jsonl"
    lines, ids = _lines(300, seed=12)
    local_in.write_bytes(_jsonl(lines))
    output = f"s3://{bucket}/out"
    storage = {"s3_endpoint_url": moto_s3.url}
    run_job(
        _job(str(local_in), output, storage=storage, output_options={"rows_per_shard": 100}),
        show_progress=False,
    )
    assert len([k for k in moto_s3.keys(bucket) if "/results-" in k]) == 3
    run_job(
        _job(str(local_in), output, storage=storage, overwrite=True, output_options={"rows_per_shard": 1000}),
        show_progress=False,
    )
    assert moto_s3.keys(bucket) == [
        "out/errors-00000-of-00001.jsonl",
        "out/manifest.json",
        "out/report.html",
        "out/results-00000-of-00001.jsonl",
    ]


def test_s3_glob_gzip_and_fingerprint_follow_the_objects(moto_s3):
    bucket = moto_s3.bucket("glob")
    moto_s3.put(bucket, "in/a.jsonl", _jsonl(_lines(3, seed=13)[0]))
    moto_s3.put(bucket, "in/b.jsonl.gz", gzip.compress(_jsonl(_lines(2, seed=14)[0])))
    moto_s3.put(bucket, "in/c.txt", b"not matched")
    storage = StorageConfig(s3_endpoint_url=moto_s3.url, **FAST_RETRIES)
    source = input_source(f"s3://{bucket}/in/*.jsonl*", storage)
    assert [f.name for f in source.files] == [f"s3://{bucket}/in/a.jsonl", f"s3://{bucket}/in/b.jsonl.gz"]
    stats = ReadStats()
    rows = list(source.rows(stats))
    assert [(r.source.rsplit("/", 1)[-1], r.number) for r in rows] == [
        ("a.jsonl", 1),
        ("a.jsonl", 2),
        ("a.jsonl", 3),
        ("b.jsonl.gz", 1),
        ("b.jsonl.gz", 2),
    ]
    assert stats.fingerprint == source.fingerprint()
    moto_s3.put(
        bucket, "in/a.jsonl", _jsonl(_lines(4, seed=13)[0])
    )  # the input changes: so does its fingerprint
    assert input_source(f"s3://{bucket}/in/*.jsonl*", storage).fingerprint() != stats.fingerprint
