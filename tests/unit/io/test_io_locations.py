"""pipeline.io.locations: parsing, URL joining/redaction, what counts as transient, bounded logged retries."""

from __future__ import annotations

import urllib.error

import pytest
import structlog

from pipeline.io.locations import (
    HttpStatusError,
    LocationError,
    RetryPolicy,
    RetryStats,
    is_transient,
    join_url,
    parse_location,
    redact_url,
    with_retries,
)


def test_parse_location_kinds(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    s3 = parse_location("s3://bucket/a/b/")
    assert (s3.kind, s3.bucket, s3.key, s3.url) == ("s3", "bucket", "a/b/", "s3://bucket/a/b/")
    assert parse_location("s3://bucket").key == ""
    assert parse_location("https://h:8/x?sig=1").kind == "http"
    assert parse_location("~/in.jsonl").path == f"{tmp_path}/in.jsonl"
    assert parse_location("file:///data/x.jsonl").path == "/data/x.jsonl"
    assert parse_location("shards/*.jsonl").has_glob()
    assert not parse_location("https://h/x*y").has_glob()
    for bad in ("s3://", "gs://bucket/x", "http://"):
        with pytest.raises(LocationError):
            parse_location(bad)


def test_join_and_redact_urls():
    assert join_url("https://h/out?X-Sig=abc", "results-00000-of-00001.jsonl") == (
        "https://h/out/results-00000-of-00001.jsonl?X-Sig=abc"
    )
    assert join_url("http://h/out/", "manifest.json") == "http://h/out/manifest.json"
    assert redact_url("https://user:pw@h/x.jsonl?X-Amz-Signature=s") == "https://h/x.jsonl?…"
    assert redact_url("http://h/x") == "http://h/x"


class FakeClientError(Exception):
    def __init__(self, code: str, status: int) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


@pytest.mark.parametrize(
    "exc, transient",
    [
        (HttpStatusError("GET", "http://h", 503), True),
        (HttpStatusError("GET", "http://h", 429), True),
        (HttpStatusError("GET", "http://h", 404), False),
        (HttpStatusError("PUT", "http://h", 403), False),
        (ConnectionRefusedError(), True),
        (TimeoutError(), True),
        (urllib.error.URLError("refused"), True),
        (FakeClientError("SlowDown", 503), True),
        (FakeClientError("InternalError", 500), True),
        (FakeClientError("NoSuchBucket", 404), False),
        (FakeClientError("AccessDenied", 403), False),
        (FileNotFoundError("x"), False),
        (ValueError("x"), False),
    ],
)
def test_is_transient(exc, transient):
    assert is_transient(exc) is transient


def test_translated_s3_error_keeps_its_code():
    wrapped = PermissionError("denied")
    wrapped.__cause__ = FakeClientError("SlowDown", 503)
    assert is_transient(wrapped)


def test_with_retries_backs_off_logs_and_counts():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise HttpStatusError("GET", "http://h/x?sig=secret", 503)
        return "ok"

    before = RetryStats.snapshot()
    with structlog.testing.capture_logs() as logs:
        assert with_retries(flaky, "GET http://h/x", RetryPolicy(retries=3, backoff_s=0)) == "ok"
    assert len(calls) == 3
    assert [entry["attempt"] for entry in logs] == [1, 2]
    assert all(entry["of"] == 4 and "503" in entry["error"] for entry in logs)
    assert "secret" not in str(logs)
    assert RetryStats.since(before) == {"retries": 2, "by_operation": {"GET": 2}}


def test_with_retries_is_bounded_and_skips_permanent_errors():
    calls = []

    def down():
        calls.append(1)
        raise ConnectionRefusedError("refused")

    with pytest.raises(ConnectionRefusedError):
        with_retries(down, "GET x", RetryPolicy(retries=2, backoff_s=0))
    assert len(calls) == 3

    calls.clear()

    def missing():
        calls.append(1)
        raise HttpStatusError("GET", "http://h", 404)

    with pytest.raises(HttpStatusError):
        with_retries(missing, "GET x", RetryPolicy(retries=5, backoff_s=0))
    assert len(calls) == 1


def test_backoff_doubles_up_to_the_cap():
    policy = RetryPolicy(retries=6, backoff_s=0.5, backoff_max_s=3)
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3, 3]
