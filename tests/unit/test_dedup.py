"""Ingest in pieces with id buckets (runtime/ingest/tasks.py, runtime/ingest/dedup.py) against the one-pass reference.

The reference is the validator with its one set of ids, reading the input in one stream (`iter_validated`), and
fitting's own measuring pass over the staged work list (`measure.measure`). However the input is cut into pieces and the
ids into buckets, the result must be the same: the same error records byte for byte (ids included), the same work
list in the same order, the same counts, the same Lengths."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import JobConfig
from pipeline.engines import fake
from pipeline.engines.fitting import FitTarget
from pipeline.fit_record import Lengths
from pipeline.io.readers import input_source
from pipeline.io.staging import StagingArea
from pipeline.max_tokens import output_budget
from pipeline.models import ResolvedModel
from pipeline.runtime.ingest import measure
from pipeline.runtime.ingest.dedup import bucket_of
from pipeline.runtime.ingest.tasks import IngestReport, ingest
from pipeline.stages.intake import InputCounts, iter_validated
from pipeline.stages.validate import InvalidLine, LineValidator

MODEL = "smollm2-135m-instruct"
JOB = "job-7"


def chat(custom_id: str, words: int = 2, **body) -> str:
    body = {"messages": [{"role": "user", "content": " ".join(["w"] * words)}], **body}
    return json.dumps({"custom_id": custom_id, "url": "/v1/chat/completions", "body": body})


def staging_at(path: Path) -> StagingArea:
    area = StagingArea(path)
    area.create()
    return area


def work_list(staging: StagingArea) -> list[tuple]:
    rows = []
    for part in staging.request_files():
        for row in pq.read_table(part).to_pylist():
            rows.append((row["custom_id"], row["line"], row["source"], json.loads(row["body"])))
    return rows


def error_records(staging: StagingArea) -> list[str]:
    return sorted(staging.iter_column("errors", "record"))


def reference(location: Path | str) -> tuple[list[tuple], list[str], InputCounts]:
    report = InputCounts(source=str(location))
    requests, errors = [], []
    for outcome in iter_validated(location, LineValidator(MODEL, JOB), report):
        if isinstance(outcome, InvalidLine):
            errors.append(json.dumps(outcome.record, ensure_ascii=False, separators=(",", ":")))
        else:
            requests.append((outcome.custom_id, outcome.line, outcome.source, outcome.body))
    return requests, errors, report


def normalized(records: list[str]) -> list[dict]:
    return sorted((json.loads(r) for r in records), key=lambda r: (r["error"]["source"], r["error"]["line"]))


def check_against_reference(location: Path, out: Path, **options) -> IngestReport:
    staging = staging_at(out)
    report = ingest(input_source(str(location)), MODEL, staging, job_id=JOB, **options)
    requests, errors, expected = reference(location)
    assert work_list(staging) == requests
    assert normalized(error_records(staging)) == normalized(errors)
    assert (report.lines, report.valid, report.invalid) == (expected.lines, expected.valid, expected.invalid)
    assert report.invalid_by_code == +expected.invalid_by_code
    assert staging.files.list_parts(staging.ids_dir) == [] and not Path(staging.ids_dir).exists()
    return report


def test_first_occurrence_wins_across_files_and_ranges(tmp_path: Path):
    shards = tmp_path / "in"
    shards.mkdir()
    # a.jsonl, cut into many ranges: "dup" first on line 2, again on line 5 (an invalid line still claims it).
    (shards / "a.jsonl").write_text(
        "\n".join([chat("a1"), chat("dup"), chat("a3"), "{broken", chat("dup", temperature=-1), chat("b1")])
        + "\n"
    )
    # b.jsonl: "b1" was claimed by a.jsonl's last line; "x" is first claimed here by an invalid line.
    (shards / "b.jsonl").write_text(
        "\n".join([chat("b1"), chat("x", temperature=-1), chat("x"), chat("dup")])
    )
    pq.write_table(
        pa.table(
            {"custom_id": ["x", "p"], "url": ["/v1/completions"] * 2, "body": ["{oops", '{"prompt": "q"}']}
        ),
        shards / "c.parquet",
    )
    out = tmp_path / "out"
    report = check_against_reference(shards, out, range_bytes=40, buckets=3)
    assert report.invalid_by_code["duplicate_custom_id"] == 5
    staging = StagingArea(out)
    assert [(cid, line) for cid, line, _, _ in work_list(staging)] == [
        ("a1", 1),
        ("dup", 2),
        ("a3", 3),
        ("b1", 6),
        ("p", 2),
    ]
    records = normalized(error_records(staging))
    dups = [
        (Path(r["error"]["source"]).name, r["error"]["line"])
        for r in records
        if r["error"]["code"] == "duplicate_custom_id"
    ]
    assert dups == [("a.jsonl", 5), ("b.jsonl", 1), ("b.jsonl", 3), ("b.jsonl", 4), ("c.parquet", 1)]
    pieces, _ = input_source(str(shards)).plan_reads(40)
    assert len(pieces) > 3 and report.placement["read"] == {"local": len(pieces)}  # in this process: "local"
    assert "local" in report.nodes()


LINES = st.lists(
    st.tuples(
        st.sampled_from(["valid", "invalid", "bad_json", "no_id", "model"]),
        st.sampled_from(["a", "b", "c", "d", "é", "x" * 30]),
    ),
    max_size=40,
)


def render(kind: str, custom_id: str) -> str:
    if kind == "valid":
        return chat(custom_id)
    if kind == "invalid":
        return chat(custom_id, max_tokens=0)
    if kind == "model":
        return chat(custom_id, model="other")
    if kind == "no_id":
        return json.dumps({"url": "/v1/chat/completions", "body": {}})
    return '{"custom_id": "' + custom_id + '", '


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    files=st.lists(LINES, min_size=1, max_size=3),
    range_bytes=st.integers(16, 2000),
    buckets=st.integers(1, 4),
    blank=st.booleans(),
)
def test_pieces_and_buckets_agree_with_one_pass(tmp_path_factory, files, range_bytes, buckets, blank):
    root = tmp_path_factory.mktemp("dedup")
    shards = root / "in"
    shards.mkdir()
    for i, lines in enumerate(files):
        text = ("\n\n" if blank else "\n").join(render(kind, cid) for kind, cid in lines)
        (shards / f"{i}.jsonl").write_text(text)
    check_against_reference(shards, root / "out", range_bytes=range_bytes, buckets=buckets)


def test_bucket_of_is_stable_and_spreads():
    assert bucket_of("req-1", 7) == bucket_of("req-1", 7)
    counts = Counter(bucket_of(f"req-{i}", 8) for i in range(8000))
    assert len(counts) == 8 and min(counts.values()) > 800


# --- measuring in the tasks vs fitting's own pass -------------------------------------------------------------


def word_target(limit: int):
    def count(requests):
        out = []
        for _, body in requests:
            text = body["messages"][0]["content"]
            out.append(ValueError("template error") if text == "BAD" else [len(text.split())])
        return out

    return FitTarget(
        counted_by="words",
        count=count,
        output_budget=lambda url, body: output_budget(url, body, None, 50),
        model_limit=limit,
        block_size=lambda args, device: 16,
        capacity=lambda args, device: None,
    )


@pytest.fixture
def words(monkeypatch):
    monkeypatch.setattr(fake, "fit_target", lambda model, args, default_max_tokens: word_target(100))
    config = JobConfig.model_validate({"engine": {"backend": "fake"}})
    model = ResolvedModel(name=MODEL, path="/nowhere", revision=None, source="local-dir")
    spec = measure.measuring(config, model)
    assert spec is not None and spec.limit == 100
    return spec


REQUESTS = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c", "d", "e"]),
        st.integers(1, 130),  # words: past 100 the prompt alone is too long
        st.sampled_from([None, 1, 30, 60]),  # max_tokens
        st.booleans(),  # untokenizable
    ),
    max_size=30,
)


def _summary(lengths: Lengths) -> dict:
    return {**lengths.summary().model_dump(), "seconds": None, "too_long": lengths.too_long}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=REQUESTS, range_bytes=st.integers(40, 3000), buckets=st.integers(1, 3))
def test_measuring_in_the_tasks_agrees_with_fittings_pass(
    tmp_path_factory, words, requests, range_bytes, buckets
):
    root = tmp_path_factory.mktemp("measure")
    lines = []
    for cid, n, max_tokens, bad in requests:
        body = {"max_tokens": max_tokens} if max_tokens else {}
        line = json.loads(chat(cid, n, **body))
        if bad:
            line["body"]["messages"][0]["content"] = "BAD"
        lines.append(json.dumps(line))
    path = root / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")

    measured = staging_at(root / "measured")
    report = ingest(
        path, MODEL, measured, job_id=JOB, measure=words, range_bytes=range_bytes, buckets=buckets
    )

    serial = staging_at(root / "serial")
    before = ingest(path, MODEL, serial, job_id=JOB, parallel=False)
    lengths = measure.measure(serial, words.target(), words.limit, job_id=JOB)

    assert _summary(report.lengths) == _summary(lengths)
    assert error_records(measured) == error_records(serial)
    assert [r[:2] for r in work_list(measured)] == [r[:2] for r in work_list(serial)]
    assert report.valid == before.valid - lengths.too_long
    assert report.invalid_by_code["context_length_exceeded"] == lengths.too_long
    assert report.invalid == before.invalid + lengths.too_long


def test_a_too_long_line_that_is_also_a_duplicate_is_a_duplicate(tmp_path: Path, words):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([chat("a", 3), chat("a", 500), chat("b", 500), chat("b", 3)]) + "\n")
    staging = staging_at(tmp_path / "out")
    report = ingest(path, MODEL, staging, job_id=JOB, measure=words, range_bytes=50, buckets=2)
    codes = {
        (
            json.loads(r)["custom_id"],
            (json.loads(r)["error"] or json.loads(r)["response"]["body"]["error"])["code"],
        )
        for r in error_records(staging)
    }
    assert codes == {
        ("a", "duplicate_custom_id"),
        ("b", "context_length_exceeded"),
        ("b", "duplicate_custom_id"),
    }
    assert [r[:2] for r in work_list(staging)] == [("a", 1)]
    assert report.lengths.too_long == 1 and report.lengths.requests == 1
    assert report.lengths.longest_id == "a"


def test_lengths_of_shuffled_buckets_name_the_first_of_equally_long_requests(tmp_path: Path, words):
    rng = random.Random(3)
    lines = [chat(f"r{i:03d}", rng.choice([5, 40]), max_tokens=10) for i in range(200)]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    first_long = next(
        i
        for i, line in enumerate(lines)
        if len(json.loads(line)["body"]["messages"][0]["content"].split()) == 40
    )
    for buckets in (1, 5, 16):
        staging = staging_at(tmp_path / f"out-{buckets}")
        report = ingest(path, MODEL, staging, job_id=JOB, measure=words, range_bytes=999, buckets=buckets)
        assert report.lengths.longest_id == f"r{first_long:03d}" and report.lengths.longest_need == 50
