"""S3 in, S3 out, on the real vLLM engine: a small Parquet input (`body` as a JSON string,
one bad row) read from a local S3 endpoint (moto server on loopback), results written back as JSONL shards, staging
in the bucket and gone after the commit. The large S3 jobs run on the fake engine in tests/integration. On the
session's warm engines (tests/e2e/warm_cluster.py): what is checked is the object store's side, not the engine's start."""

# ruff: noqa: F811 - the pytest fixture imported from storage_fixtures is re-bound as a test argument

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.e2e.cli import run_cli
from tests.integration.storage_fixtures import moto_s3  # noqa: F401
from tests.lines import MODEL_NAME

pytestmark = pytest.mark.slow

QUESTIONS = {
    "q-3": "What do bees make?",
    "q-1": "Name three primary colors.",
    "q-2": "Who wrote Hamlet?",
}


def _parquet_input() -> bytes:
    rows = [
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": json.dumps(
                {
                    "model": MODEL_NAME,
                    "messages": [{"role": "user", "content": question}],
                    "max_tokens": 16,
                    "temperature": 0,
                }
            ),
        }
        for custom_id, question in QUESTIONS.items()
    ]
    rows.append({"custom_id": "broken", "method": "POST", "url": "/v1/chat/completions", "body": "{not json"})
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue()


def test_s3_parquet_in_jsonl_out_on_the_real_engine(moto_s3, shared_engines, tmp_path):
    bucket = moto_s3.bucket("e2e")
    moto_s3.put(bucket, "in/part-0.parquet", _parquet_input())

    done = run_cli(
        "run", f"s3://{bucket}/in/", f"s3://{bucket}/out", "--s3-endpoint-url", moto_s3.url,
        *shared_engines.one_pool_job(tmp_path), "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    keys = moto_s3.keys(bucket, "out/")
    assert "out/manifest.json" in keys
    assert not [k for k in keys if "/_staging/" in k], "staging must be gone from the bucket after the commit"
    manifest = json.loads(moto_s3.get(bucket, "out/manifest.json"))
    assert manifest["counts"]["total"] == 4
    results = [
        json.loads(line)
        for shard in manifest["shards"]["results"]
        for line in moto_s3.get(bucket, f"out/{shard['name']}").decode().splitlines()
    ]
    errors = [
        json.loads(line)
        for shard in manifest["shards"]["errors"]
        for line in moto_s3.get(bucket, f"out/{shard['name']}").decode().splitlines()
    ]
    assert [r["custom_id"] for r in results] == sorted(QUESTIONS)  # sorted by custom_id, every valid row
    for record in results:
        body = record["response"]["body"]
        assert record["response"]["status_code"] == 200
        assert body["model"] == MODEL_NAME and body["choices"][0]["message"]["content"].strip()
        assert body["usage"]["completion_tokens"] > 0
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("broken", "invalid_json")]
    assert len(results) + len(errors) == manifest["counts"]["total"]
