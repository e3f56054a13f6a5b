"""runtime.ingest over the readers: shards of mixed formats, Parquet rows with bad bodies, duplicates across files,
and the work list's body JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.io.readers import input_source
from pipeline.io.staging import StagingArea
from pipeline.json_codec import dumps_body as body_json
from pipeline.runtime.ingest.tasks import ingest
from tests.staged_rows import staged_rows

MODEL = "smollm2-135m-instruct"


def chat(custom_id: str) -> str:
    body = {"messages": [{"role": "user", "content": f"hi {custom_id}"}]}
    return json.dumps({"custom_id": custom_id, "url": "/v1/chat/completions", "body": body})


@pytest.fixture
def staging(tmp_path: Path) -> StagingArea:
    area = StagingArea(tmp_path / "out")
    area.create()
    return area


def test_mixed_shards_share_one_duplicate_check(tmp_path: Path, staging: StagingArea):
    shards = tmp_path / "in"
    shards.mkdir()
    (shards / "a.jsonl").write_text(chat("x") + "\n" + chat("y") + "\n")
    pq.write_table(
        pa.table(
            {
                "custom_id": ["y", "z", "w", "w"],
                "url": ["/v1/completions"] * 4,
                "body": ['{"prompt": "p"}', '{"prompt": "q"}', "{oops", '{"prompt": "r"}'],
            }
        ),
        shards / "b.parquet",
    )
    report = ingest(input_source(str(shards)), MODEL, staging, job_id="job1")
    assert (report.lines, report.valid, report.files) == (6, 3, 2)
    assert dict(report.invalid_by_code) == {"duplicate_custom_id": 2, "invalid_json": 1}
    errors = [json.loads(r.record) for r in staged_rows(staging, "errors")]
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors] == [
        ("y", "duplicate_custom_id", 1),
        ("w", "invalid_json", 3),
        ("w", "duplicate_custom_id", 4),  # a row with a broken body still claims its custom_id
    ]
    assert all(e["error"]["source"].endswith("b.parquet") for e in errors)
    requests = pa.concat_tables(pq.read_table(p) for p in staging.request_files()).to_pylist()
    assert [r["custom_id"] for r in requests] == ["x", "y", "z"]
    assert json.loads(requests[2]["body"]) == {"prompt": "q", "model": MODEL}
    assert report.source == str(shards.resolve())


def test_body_json_matches_the_stdlib_where_it_matters():
    body = {"model": "m", "messages": [{"role": "user", "content": "é 😀"}], "temperature": 0.1, "n": 2**70}
    raw = json.dumps({"body": body}).encode()
    assert json.loads(body_json(body, raw)) == body
    with_nan = json.loads('{"logit_bias": {"1": NaN}}')
    text = body_json(with_nan, b'{"logit_bias": {"1": NaN}}')
    assert math.isnan(json.loads(text)["logit_bias"]["1"])  # NaN kept, not turned into null
    assert json.loads(body_json({"a": 1.5}, {"parsed": "dict"})) == {"a": 1.5}
