"""runtime.ingest: read → validate → stage, line numbers, accounting, fingerprint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.io.readers import input_source
from pipeline.io.staging import StagingArea
from pipeline.runtime.ingest.tasks import ingest
from tests.staged_rows import staged_rows

MODEL = "smollm2-135m-instruct"


def chat(custom_id: str, **body) -> str:
    body = {"messages": [{"role": "user", "content": f"hello {custom_id}"}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def completion(custom_id: str, **body) -> str:
    body = {"model": MODEL, "prompt": f"once {custom_id}", **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


@pytest.fixture
def staging(tmp_path: Path) -> StagingArea:
    area = StagingArea(tmp_path / "out")
    area.create()
    return area


def read_requests(staging: StagingArea) -> list[dict]:
    rows: list[dict] = []
    for part in staging.request_files():
        rows.extend(pq.read_table(part).to_pylist())
    return rows


def read_errors(staging: StagingArea) -> list[dict]:
    return [json.loads(row.record) for row in staged_rows(staging, "errors")]


def test_ingest_mixed_input_with_blank_lines(tmp_path: Path, staging: StagingArea):
    lines = [
        chat("a"),  # 1
        "",  # 2 blank
        "not json",  # 3
        completion("b", max_tokens=4),  # 4
        "   \t",  # 5 whitespace only
        chat("a"),  # 6 duplicate
        chat("c", temperature=-1),  # 7
        "",  # 8
        "",  # 9
        completion("d", model="gpt-4o"),  # 10
        chat("e"),  # 11
    ]
    path = tmp_path / "input.jsonl"
    data = ("\n".join(lines) + "\n\n").encode()
    path.write_bytes(data)

    report = ingest(path, MODEL, staging)

    # accounting: non-blank lines only, valid + invalid == lines
    assert report.lines == 7
    assert report.valid == 3
    assert report.invalid == 4
    assert report.valid + report.invalid == report.lines
    assert dict(report.invalid_by_code) == {
        "invalid_json": 1,
        "duplicate_custom_id": 1,
        "invalid_request": 1,
        "model_not_found": 1,
    }

    # fingerprint: sha256 of the exact file bytes (blank lines included), and the size
    assert report.fingerprint == "sha256:" + hashlib.sha256(data).hexdigest()
    assert report.size_bytes == len(data)
    assert report.source == str(path)

    # valid requests → the requests parquet, with editor-true line numbers and the job's model filled in
    requests = read_requests(staging)
    assert [(r["custom_id"], r["line"]) for r in requests] == [("a", 1), ("b", 4), ("e", 11)]
    assert {r["source"] for r in requests} == {str(path)}
    assert [r["url"] for r in requests] == ["/v1/chat/completions", "/v1/completions", "/v1/chat/completions"]
    bodies = [json.loads(r["body"]) for r in requests]
    assert all(b["model"] == MODEL for b in bodies)
    assert bodies[1] == {"model": MODEL, "prompt": "once b", "max_tokens": 4}

    # invalid lines → staged error rows, with the right line numbers and codes
    errors = read_errors(staging)
    assert [(e["error"]["line"], e["error"]["code"], e["custom_id"]) for e in errors] == [
        (3, "invalid_json", None),
        (6, "duplicate_custom_id", "a"),
        (7, "invalid_request", "c"),
        (10, "model_not_found", "d"),
    ]
    assert all(e["error"]["source"] == str(path) and e["response"] is None for e in errors)
    staged = list(staged_rows(staging, "errors"))
    assert [r.error_code for r in staged] == [
        "invalid_json",
        "duplicate_custom_id",
        "invalid_request",
        "model_not_found",
    ]
    assert [r.line for r in staged] == [3, 6, 7, 10]
    assert len(requests) + len(errors) == report.lines


def test_ingest_counts(tmp_path: Path, staging: StagingArea):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([chat("a"), "{", chat("b"), "[]"]))  # no trailing newline
    report = ingest(path, MODEL, staging)
    assert (report.lines, report.valid, report.invalid) == (4, 2, 2)
    assert dict(report.invalid_by_code) == {"invalid_json": 2}
    assert report.fingerprint == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert [r["line"] for r in read_requests(staging)] == [1, 3]
    assert [e["error"]["line"] for e in read_errors(staging)] == [2, 4]


def test_the_work_list_records_each_requests_output_budget(tmp_path: Path, staging: StagingArea):
    # The queue hands the job's last rows out longest first by it; a request that sets none may run to the context.
    path = tmp_path / "in.jsonl"
    lines = [chat("a", max_tokens=40), chat("b"), chat("c", max_completion_tokens=7, max_tokens=99)]
    path.write_text("\n".join([*lines, completion("d", max_tokens=3)]) + "\n")
    ingest(path, MODEL, staging)
    budgets = {r["custom_id"]: r["output_budget"] for r in read_requests(staging)}
    assert budgets == {"a": 40, "b": None, "c": 7, "d": 3}


def test_ingest_crlf_and_unicode(tmp_path: Path, staging: StagingArea):
    path = tmp_path / "in.jsonl"
    data = (chat("ключ") + "\r\n\r\n" + chat("😀", max_tokens=2) + "\r\n").encode("utf-8")
    path.write_bytes(data)
    report = ingest(path, MODEL, staging)
    assert (report.lines, report.valid, report.invalid) == (2, 2, 0)
    requests = read_requests(staging)
    assert [(r["custom_id"], r["line"]) for r in requests] == [("ключ", 1), ("😀", 3)]
    assert json.loads(requests[0]["body"])["messages"][0]["content"] == "hello ключ"
    assert report.fingerprint == "sha256:" + hashlib.sha256(data).hexdigest()


def test_ingest_splits_parts(tmp_path: Path, staging: StagingArea):
    path = tmp_path / "in.jsonl"
    lines = [chat(f"r{i:02d}") if i % 3 else "oops" for i in range(20)]
    path.write_text("\n".join(lines) + "\n")
    report = ingest(path, MODEL, staging, part_rows=4)
    assert (report.lines, report.valid, report.invalid) == (20, 13, 7)
    assert len(staging.request_files()) == 4  # 13 requests in parts of at most 4
    assert len(staging.parts("errors")) == 2  # 7 errors in parts of at most 4
    assert [r["custom_id"] for r in read_requests(staging)] == [f"r{i:02d}" for i in range(20) if i % 3]
    assert staging.count("errors") == 7


def test_ingest_empty_and_blank_only(tmp_path: Path, staging: StagingArea):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n  \n\r\n")
    report = ingest(path, MODEL, staging)
    assert (report.lines, report.valid, report.invalid) == (0, 0, 0)
    assert staging.request_files() == [] and staging.parts("errors") == []
    assert report.fingerprint == "sha256:" + hashlib.sha256(b"\n  \n\r\n").hexdigest()


def test_ingest_lone_surrogate_becomes_error_record(tmp_path: Path, staging: StagingArea):
    path = tmp_path / "in.jsonl"
    bad = '{"custom_id": "x", "url": "/v1/completions", "body": {"prompt": "a\\udc00"}}'
    path.write_text("\n".join([chat("a"), bad, chat("b")]) + "\n")
    report = ingest(path, MODEL, staging)
    assert (report.lines, report.valid, report.invalid) == (3, 2, 1)
    assert [e["error"]["line"] for e in read_errors(staging)] == [2]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "é 😀"}], "max_tokens": 4},
        {"messages": [], "logit_bias": {"7": float("nan")}},  # only the stdlib writes NaN back as NaN
        {"messages": [], "stop": None, "n": 2**70},
    ],
)
def test_work_list_bodies_are_the_stdlib_json_of_the_parsed_body(body):
    import json as stdlib_json

    from pipeline.json_codec import dumps_body as body_json

    expected = stdlib_json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    assert body_json(body, {"parquet": "row"}) == expected  # an already-parsed row
    raw = expected.encode()
    assert body_json(stdlib_json.loads(raw), raw) == expected  # a raw JSONL line


def test_hostile_lines_become_error_records_and_the_rest_run(tmp_path: Path, staging: StagingArea):
    """Lines from other tools' test suites and from no one's good intentions: each is one error record."""
    from pipeline.config import InputLimits

    lines = [
        chat("ok-1"),
        chat("stream-str", stream="True"),  # vLLM's run-batch tests send exactly this
        chat("stream-int", stream=1),
        chat("stream-off", stream="false"),  # read as false, as vLLM reads it: runs
        "[" * 5_000 + "]" * 5_000,
        json.dumps(
            {
                "custom_id": "deep",
                "url": "/v1/completions",
                "body": {"prompt": "p", "x": [[[[[[[[[[]]]]]]]]]]},
            }
        ),
        json.dumps({"custom_id": "big", "url": "/v1/completions", "body": {"prompt": "y" * 20_000}}),
        chat("x" * 600),
        chat("   "),
        chat("ctl\u0007"),
        chat("tokens", max_tokens=1e30),
        chat("tokens-str", max_tokens="12"),  # read as 12: runs
        json.dumps(
            {"custom_id": "lower", "method": "post", "url": "/v1/completions", "body": {"prompt": "p"}}
        ),
        completion("ok-2"),
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    limits = InputLimits(max_line_bytes=16_384, max_json_depth=10)
    report = ingest(path, MODEL, staging, limits=limits)
    assert report.lines == len(lines) == report.valid + report.invalid
    assert report.invalid_by_code["invalid_json"] == 2
    assert sorted(r["custom_id"] for r in read_requests(staging)) == [
        "ok-1",
        "ok-2",
        "stream-off",
        "tokens-str",
    ]
    codes = {(e["custom_id"], e["error"]["code"]) for e in read_errors(staging)}
    assert codes == {
        ("stream-str", "stream_unsupported"),
        ("stream-int", "stream_unsupported"),
        (None, "invalid_json"),  # both too-deep lines: refused before their custom_id is read
        (None, "line_too_long"),
        (None, "invalid_custom_id"),
        ("   ", "invalid_custom_id"),
        ("ctl\u0007", "invalid_custom_id"),
        ("tokens", "invalid_request"),
        ("lower", "unsupported_method"),
    }
    bodies = {r["custom_id"]: json.loads(r["body"]) for r in read_requests(staging)}
    assert bodies["tokens-str"]["max_tokens"] == 12 and bodies["stream-off"]["stream"] is False


def test_ingest_tasks_are_pinned_to_the_drivers_node_only_when_local_files_are_out_of_other_hosts_reach(
    tmp_path: Path,
):
    from pipeline.config import StorageConfig
    from pipeline.io.input_files import InputFile
    from pipeline.io.locations import parse_location
    from pipeline.io.readers import InputSource
    from pipeline.io.staging import ObjectStoreFiles
    from pipeline.runtime.hosting.executor import place_tasks
    from pipeline.runtime.ingest.tasks import on_drivers_disk

    def pinned_to(source, staging, nodes, driver):
        return place_tasks(on_drivers_disk(source, staging), nodes, driver, cluster_cpus=3).node

    def node(node_id: str, host: str) -> dict:
        return {"NodeID": node_id, "NodeManagerAddress": host, "Alive": True}

    one_host = [node("d", "10.0.0.1"), node("w", "10.0.0.1")]
    two_hosts = [node("d", "10.0.0.1"), node("w", "10.0.0.2"), {**node("x", "10.0.0.3"), "Alive": False}]
    path = tmp_path / "in.jsonl"
    path.write_text(chat("a") + "\n")
    local_input = input_source(str(path))
    s3_input = InputSource(
        parse_location("s3://bucket/in.jsonl"), [InputFile("s3://bucket/in.jsonl", "bucket/in.jsonl", 9)]
    )
    local_staging = StagingArea(tmp_path / "out")
    s3_staging = StagingArea("bucket/out", ObjectStoreFiles(StorageConfig(), tmp_path / "cache"))

    assert pinned_to(local_input, s3_staging, two_hosts, "d") == "d"
    assert pinned_to(s3_input, local_staging, two_hosts, "d") == "d"
    assert pinned_to(s3_input, s3_staging, two_hosts, "d") is None
    assert pinned_to(local_input, local_staging, one_host, "d") is None  # every node reads the driver's disk
    assert (
        pinned_to(local_input, local_staging, [two_hosts[0], two_hosts[2]], "d") is None
    )  # the other one is gone
