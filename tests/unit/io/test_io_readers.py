"""pipeline.io.readers: enumeration (file, directory, glob), JSONL line numbering, Parquet bodies (struct / JSON
string), fingerprints, and ranged S3 reads that resume after a failure."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import StorageConfig
from pipeline.io.jsonl import iter_jsonl
from pipeline.io.locations import LocationError, RetryPolicy
from pipeline.io.readers import check_parquet_schemas, input_source
from pipeline.io.rows import BadRow, InputFormatError, ReadStats
from pipeline.io.s3_input import S3RangeReader


def rows_of(location, **kwargs):
    stats = ReadStats()
    rows = list(input_source(str(location), **kwargs).rows(stats))
    return rows, stats


# -- JSONL -------------------------------------------------------------------------------------------------------------


def test_jsonl_numbering_skips_blank_lines_but_counts_them():
    data = b'{"a":1}\n\n  \t\n{"b":2}\r\n{"c":3}\n\n'
    rows = list(iter_jsonl(io.BytesIO(data), "f.jsonl"))
    assert [(r.number, r.payload) for r in rows] == [(1, b'{"a":1}'), (4, b'{"b":2}'), (5, b'{"c":3}')]
    assert {r.source for r in rows} == {"f.jsonl"}


def test_jsonl_without_final_newline_and_with_bom():
    rows = list(iter_jsonl(io.BytesIO(b'\xef\xbb\xbf{"a":1}\n{"b":2}'), "f"))
    assert [(r.number, r.payload) for r in rows] == [(1, b'{"a":1}'), (2, b'{"b":2}')]


def test_local_file_fingerprint_is_sha256_of_the_bytes(tmp_path: Path):
    data = b'{"a":1}\n\n{"b":2}\ntrailing-without-newline'
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    rows, stats = rows_of(path)
    assert [r.number for r in rows] == [1, 3, 4]
    assert stats.fingerprint == "sha256:" + hashlib.sha256(data).hexdigest()
    assert stats.size_bytes == len(data)
    assert input_source(str(path)).fingerprint() == stats.fingerprint


def test_gzip_jsonl(tmp_path: Path):
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"a":1}\n\n{"b":2}\n'))
    rows, stats = rows_of(path)
    assert [(r.number, r.payload) for r in rows] == [(1, b'{"a":1}'), (3, b'{"b":2}')]
    assert stats.size_bytes == path.stat().st_size  # the fingerprint covers the stored (compressed) bytes


# -- enumeration -------------------------------------------------------------------------------------------------------


def make_shards(root: Path) -> None:
    (root / "sub").mkdir(parents=True)
    (root / "b.jsonl").write_text('{"n":"b1"}\n{"n":"b2"}\n')
    (root / "a.jsonl").write_text('{"n":"a1"}\n')
    (root / "sub" / "c.jsonl").write_text('{"n":"c1"}\n')
    (root / "README.md").write_text("not input")
    (root / "_SUCCESS").write_text("")
    (root / ".hidden.jsonl").write_text('{"n":"hidden"}\n')
    (root / "_staging").mkdir()
    (root / "_staging" / "x.jsonl").write_text('{"n":"staged"}\n')


def test_directory_lists_input_shards_in_stable_order(tmp_path: Path):
    make_shards(tmp_path / "d")
    source = input_source(str(tmp_path / "d"))
    assert [Path(f.ref).relative_to(tmp_path / "d").as_posix() for f in source.files] == [
        "a.jsonl",
        "b.jsonl",
        "sub/c.jsonl",
    ]
    rows, stats = rows_of(tmp_path / "d")
    assert [json.loads(r.payload)["n"] for r in rows] == ["a1", "b1", "b2", "c1"]
    assert [r.number for r in rows] == [1, 1, 2, 1]  # numbering restarts per file
    assert rows[1].source.endswith("b.jsonl")
    assert stats.files == 3 and stats.fingerprint.startswith("sha256:")
    assert source.fingerprint() == stats.fingerprint
    (tmp_path / "d" / "a.jsonl").write_text('{"n":"A1"}\n')
    assert input_source(str(tmp_path / "d")).fingerprint() != stats.fingerprint


def test_glob(tmp_path: Path):
    make_shards(tmp_path / "d")
    source = input_source(str(tmp_path / "d" / "*.jsonl"))
    assert [Path(f.ref).name for f in source.files] == ["a.jsonl", "b.jsonl"]  # a glob takes what it matches
    with pytest.raises(LocationError, match="no files match"):
        input_source(str(tmp_path / "d" / "*.nothing"))


def test_empty_directory_and_missing_path(tmp_path: Path):
    with pytest.raises(LocationError, match="is a directory: pass a JSONL file"):
        input_source(str(tmp_path))
    with pytest.raises(LocationError, match="does not exist"):
        input_source(str(tmp_path / "missing.jsonl"))
    with pytest.raises(LocationError, match="unsupported scheme"):
        input_source("ftp://host/x.jsonl")


# -- Parquet -----------------------------------------------------------------------------------------------------------


def test_parquet_struct_bodies_drop_invented_nulls(tmp_path: Path):
    rows = [
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5},
        },
        {
            "custom_id": "b",
            "method": None,
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "yo", "name": "x"}], "max_tokens": 3},
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    got, stats = rows_of(tmp_path / "in.parquet")
    assert [(r.number, r.payload) for r in got] == [
        (
            1,
            {
                "custom_id": "a",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5},
            },
        ),
        (
            2,
            {
                "custom_id": "b",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "yo", "name": "x"}], "max_tokens": 3},
            },
        ),
    ]
    data = (tmp_path / "in.parquet").read_bytes()
    assert stats.fingerprint == "sha256:" + hashlib.sha256(data).hexdigest()


def test_parquet_map_body(tmp_path: Path):
    body_type = pa.struct([("prompt", pa.string()), ("logit_bias", pa.map_(pa.string(), pa.int64()))])
    table = pa.table(
        {
            "custom_id": ["m"],
            "url": ["/v1/completions"],
            "body": pa.array([{"prompt": "p", "logit_bias": [("50256", -100)]}], body_type),
        }
    )
    pq.write_table(table, tmp_path / "m.parquet")
    (row,), _ = rows_of(tmp_path / "m.parquet")
    assert row.payload["body"] == {"prompt": "p", "logit_bias": {"50256": -100}}


def test_parquet_json_string_bodies_without_method_column(tmp_path: Path):
    table = pa.table(
        {
            "custom_id": ["a", "b", "c"],
            "url": ["/v1/completions"] * 3,
            "body": ['{"prompt": "x", "max_tokens": 2}', "{not json", None],
            "extra": [1, 2, 3],
        }
    )
    pq.write_table(table, tmp_path / "s.parquet", row_group_size=2)
    got, _ = rows_of(tmp_path / "s.parquet")
    assert got[0].payload == {
        "custom_id": "a",
        "url": "/v1/completions",
        "body": {"prompt": "x", "max_tokens": 2},
    }
    assert isinstance(got[1].payload, BadRow) and got[1].payload.custom_id == "b"
    assert "not valid JSON" in got[1].payload.message
    assert got[2].payload == {"custom_id": "c", "url": "/v1/completions", "body": None}
    assert [r.number for r in got] == [1, 2, 3]  # row numbers run across row groups


def test_parquet_detected_by_magic_bytes_without_suffix(tmp_path: Path):
    pq.write_table(
        pa.table({"custom_id": ["a"], "url": ["/v1/completions"], "body": ['{"prompt":"p"}']}),
        tmp_path / "blob",
    )
    got, _ = rows_of(tmp_path / "blob")
    assert got[0].payload["body"] == {"prompt": "p"}


def test_parquet_without_request_columns_is_refused(tmp_path: Path):
    pq.write_table(pa.table({"id": [1], "text": ["x"]}), tmp_path / "w.parquet")
    with pytest.raises(InputFormatError, match="has no column custom_id, url, body"):
        check_parquet_schemas(input_source(str(tmp_path / "w.parquet")))
    with pytest.raises(InputFormatError, match="has no column"):
        rows_of(tmp_path / "w.parquet")


# -- ranged S3 reads ---------------------------------------------------------------------------------------------------


class FlakyFS:
    """cat_file over bytes; the ranges listed in `fail_at` fail once with a connection error."""

    def __init__(self, data: bytes, fail_at: set[int]) -> None:
        self.data = data
        self.fail_at = set(fail_at)
        self.calls: list[tuple[int, int]] = []

    def cat_file(self, key: str, start: int, end: int) -> bytes:
        self.calls.append((start, end))
        if start in self.fail_at:
            self.fail_at.discard(start)
            raise ConnectionResetError("reset by peer")
        return self.data[start:end]


def test_s3_range_reader_resumes_at_the_same_offset():
    lines = [json.dumps({"custom_id": f"r{i:04d}", "pad": "x" * (i % 13)}).encode() for i in range(500)]
    data = b"\n".join(lines) + b"\n"
    fs = FlakyFS(data, fail_at={0, 4096, 3 * 4096})
    raw = S3RangeReader(fs, "bucket/key", len(data), RetryPolicy(retries=2, backoff_s=0), chunk=4096)
    rows = list(iter_jsonl(io.BufferedReader(raw, buffer_size=1000), "s3://bucket/key"))
    assert [r.payload for r in rows] == lines  # no row lost or repeated
    assert fs.calls.count((0, 4096)) == 2 and fs.calls.count((4096, 8192)) == 2


def test_s3_range_reader_is_seekable_for_parquet():
    sink = io.BytesIO()
    pq.write_table(pa.table({"x": list(range(10_000))}), sink, row_group_size=1000)
    data = sink.getvalue()
    raw = S3RangeReader(FlakyFS(data, set()), "b/k", len(data), RetryPolicy(retries=0), chunk=2048)
    assert pq.read_table(io.BufferedReader(raw)).column("x").to_pylist() == list(range(10_000))


def test_s3_range_reader_gives_up_after_the_retries():
    data = b"x" * 100
    fs = FlakyFS(data, fail_at={0})
    raw = S3RangeReader(fs, "b/k", len(data), RetryPolicy(retries=0), chunk=64)
    with pytest.raises(ConnectionResetError):
        raw.read(10)


def test_storage_config_defaults_are_bounded():
    storage = StorageConfig()
    assert 0 < storage.retries <= 20 and storage.timeout_s > 0


# -- bounds on one line ---------------------------------------------------------------------------------------------


class _CountingStream(io.BytesIO):
    """Records the largest piece any single read handed out: the most of one line held in memory at once."""

    largest = 0

    def readline(self, size: int = -1) -> bytes:  # type: ignore[override]
        piece = super().readline(size)
        self.largest = max(self.largest, len(piece))
        return piece


def test_over_long_line_is_a_bad_row_and_never_held_whole():
    limit = 4096
    long_line = b'{"custom_id": "big", "body": "' + b"x" * (50 * limit) + b'"}'
    stream = _CountingStream(b'{"a": 1}\n' + long_line + b'\n{"b": 2}\n')
    rows = list(iter_jsonl(stream, "f.jsonl", max_line_bytes=limit))
    assert [r.number for r in rows] == [1, 2, 3]
    assert rows[0].payload == b'{"a": 1}' and rows[2].payload == b'{"b": 2}'
    bad = rows[1].payload
    assert isinstance(bad, BadRow) and bad.code == "line_too_long"
    assert f"{len(long_line):,} bytes" in bad.message and "limits.max_line_bytes" in bad.message
    assert stream.largest <= max(limit + 1, 8 << 20)  # the limit, or one bounded skip piece
    assert stream.largest < len(long_line)


def test_line_at_the_limit_is_read():
    limit = 1024
    exact = b"[" + b"1," * ((limit - 3) // 2) + b"1]"
    exact = exact + b" " * (limit - len(exact))
    rows = list(iter_jsonl(io.BytesIO(exact + b"\n" + exact), "f", max_line_bytes=limit))
    assert [r.payload for r in rows] == [exact.strip(), exact.strip()]


def test_over_long_last_line_without_newline():
    rows = list(iter_jsonl(io.BytesIO(b"y" * 5000), "f", max_line_bytes=1024))
    assert len(rows) == 1 and rows[0].payload.code == "line_too_long"


def test_parquet_body_strings_are_bounded(tmp_path: Path):
    deep = "[" * 2_000 + "]" * 2_000
    table = pa.table(
        {
            "custom_id": ["deep", "long", "fine"],
            "url": ["/v1/completions"] * 3,
            "body": [deep, json.dumps({"prompt": "x" * 5000}), '{"prompt": "x"}'],
        }
    )
    pq.write_table(table, tmp_path / "s.parquet")
    source = input_source(str(tmp_path / "s.parquet"))
    from pipeline.config import InputLimits

    source.limits = InputLimits(max_line_bytes=4096)
    got = list(source.rows())
    assert isinstance(got[0].payload, BadRow) and "nested deeper" in got[0].payload.message
    assert got[0].payload.custom_id == "deep"
    assert isinstance(got[1].payload, BadRow) and got[1].payload.code == "line_too_long"
    assert got[1].payload.custom_id == "long"
    assert got[2].payload["body"] == {"prompt": "x"}
