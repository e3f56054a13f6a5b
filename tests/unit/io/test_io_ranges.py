"""Reading an input in pieces (io/readers.py): byte ranges of a JSONL file split at line boundaries, row groups of a
Parquet file, files that cannot be split, and the fingerprint built from ranges. Every way of cutting a file must
give exactly the rows, line numbers and fingerprint of one pass over it."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import InputLimits
from pipeline.io.jsonl import iter_jsonl
from pipeline.io.pieces import file_ranges, with_line_counts
from pipeline.io.readers import input_source
from pipeline.io.rows import ReadStats


def pieced_rows(path: Path, range_bytes: int, limits: InputLimits | None = None) -> list[tuple]:
    """Every row of the input, read piece by piece as the ingest tasks read it (scans first, for line numbers)."""
    source = input_source(str(path))
    if limits:
        source.limits = limits
    pieces, scans = source.plan_reads(range_bytes)
    pieces = with_line_counts(pieces, scans, [source.scan(r)[0] for r in scans])
    return [tuple(row) for piece in pieces for row in source.piece_rows(piece)]


def whole_rows(path: Path, limits: InputLimits | None = None) -> list[tuple]:
    source = input_source(str(path))
    if limits:
        source.limits = limits
    return [tuple(row) for row in source.rows()]


TRICKY = (
    b"\xef\xbb\xbf" + b'{"custom_id": "bom"}\n'  # a BOM on line 1 only
    b"\n"  # empty
    b'{"custom_id": "crlf"}\r\n'
    b"\r\n"  # an empty CRLF line
    b"   \t\n"  # blank
    b'{"custom_id": "x", "pad": "' + b"y" * 300 + b'"}\n'  # a long line: many ranges fall inside it
    b"\n\n\n"
    b'{"custom_id": "last", "no": "newline"}'  # the final line has none
)


def test_every_range_size_reads_every_line_once_with_its_true_number(tmp_path: Path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(TRICKY)
    expected = whole_rows(path)
    assert [number for _, number, _ in expected] == [1, 3, 6, 10]
    for range_bytes in range(1, len(TRICKY) + 2):
        assert pieced_rows(path, range_bytes) == expected, range_bytes


def test_a_line_over_the_limit_is_one_bad_row_whichever_range_it_crosses(tmp_path: Path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"a": 1}\n' + b"z" * 3000 + b"\n" + b'{"b": 2}\n' + b"q" * 2000)
    limits = InputLimits(max_line_bytes=1024)
    expected = whole_rows(path, limits)
    kinds = [(n, type(p).__name__) for _, n, p in expected]
    assert kinds == [(1, "bytes"), (2, "BadRow"), (3, "bytes"), (4, "BadRow")]
    assert "3,000 bytes" in expected[1][2].message and "2,000 bytes" in expected[3][2].message
    for range_bytes in (1, 7, 9, 10, 33, 1024, 1025, 3009, 3010, 3011, 3019, 3020, 4000, 10_000):
        assert pieced_rows(path, range_bytes, limits) == expected, range_bytes


def test_a_range_inside_one_huge_line_reads_nothing(tmp_path: Path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"custom_id": "' + b"h" * 1000 + b'"}\n{"custom_id": "after"}\n')
    source = input_source(str(path))
    pieces, scans = source.plan_reads(100)
    pieces = with_line_counts(pieces, scans, [source.scan(r)[0] for r in scans])
    rows = [[n for _, n, _ in source.piece_rows(piece)] for piece in pieces]
    assert rows[0] == [1]  # the first range reads the huge line through to its end
    assert all(r == [] for r in rows[1:10])  # ranges that start and end inside it own no line
    assert sum(rows, []) == [1, 2]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(
        st.sampled_from([b"", b" ", b"{}", b'{"k": "v"}', b"x" * 40, b"\r", "é😀".encode()]), max_size=30
    ),
    ending=st.sampled_from([b"\n", b"\r\n"]),
    final_newline=st.booleans(),
    range_bytes=st.integers(1, 120),
)
def test_ranges_agree_with_one_pass(tmp_path_factory, lines, ending, final_newline, range_bytes):
    data = ending.join(lines) + (ending if final_newline and lines else b"")
    path = tmp_path_factory.mktemp("ranges") / "in.jsonl"
    path.write_bytes(data)
    assert pieced_rows(path, range_bytes) == whole_rows(path)


def test_gzip_is_never_split(tmp_path: Path):
    lines = b"".join(b'{"custom_id": "r%d"}\n' % i for i in range(500))
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(gzip.compress(lines))
    source = input_source(str(path))
    pieces, _ = source.plan_reads(64)
    assert len(pieces) == 1 and pieces[0].end is None  # one piece, the whole file
    assert pieced_rows(path, 64) == whole_rows(path)
    assert [n for _, n, _ in whole_rows(path)] == list(range(1, 501))


def test_parquet_is_split_by_row_groups_with_continuous_row_numbers(tmp_path: Path):
    path = tmp_path / "in.parquet"
    table = pa.table(
        {
            "custom_id": [f"r{i}" for i in range(100)],
            "url": ["/v1/completions"] * 100,
            "body": ['{"prompt": "p"}'] * 100,
        }
    )
    pq.write_table(table, path, row_group_size=7)
    source = input_source(str(path))
    pieces, _ = source.plan_reads(piece_rows=1)  # every row group its own piece
    assert len(pieces) == 15 and pieces[1].before == 7 and pieces[-1].start == 14
    pieces, _ = source.plan_reads(piece_rows=20)  # three row groups (21 rows) a piece, the last one 16 rows
    assert [(p.start, p.end, p.before) for p in pieces] == [
        (0, 3, 0),
        (3, 6, 21),
        (6, 9, 42),
        (9, 12, 63),
        (12, 15, 84),
    ]
    for piece_rows in (1, 20, 1000):
        rows = [tuple(r) for p in source.plan_reads(piece_rows=piece_rows)[0] for r in source.piece_rows(p)]
        assert rows == whole_rows(path)
        assert [n for _, n, _ in rows] == list(range(1, 101))


def test_range_fingerprint_is_the_file_sha256_when_small_and_combines_ranges_otherwise(
    tmp_path: Path, monkeypatch
):
    from pipeline.io import fingerprint

    path = tmp_path / "in.jsonl"
    data = b'{"custom_id": "a"}\n' * 50
    path.write_bytes(data)
    source = input_source(str(path))
    single = source.fingerprint()
    assert single == "sha256:" + hashlib.sha256(data).hexdigest()

    seen = set()
    for hash_bytes in (10, 100, len(data) - 1):
        monkeypatch.setattr(fingerprint, "HASH_RANGE_BYTES", hash_bytes)
        expected = source.fingerprint()
        for range_bytes in (7, 64, 10_000):  # the size the file is read in does not change it
            _, scans = source.plan_reads(range_bytes)
            assert [(r.start, r.end) for r in scans] == file_ranges(len(data), hash_bytes)
            assert source.local_fingerprint(scans, [source.scan(r)[1] for r in scans]) == expected
        stats = ReadStats()
        list(source.rows(stats))  # one stream over the file (the dry run) hashes it the same way
        assert stats.fingerprint == expected
        seen.add(expected)
    assert len(seen) == 3 and single not in seen


def test_line_counts_cut_hash_ranges_where_read_ranges_start(tmp_path: Path, monkeypatch):
    from pipeline.io import fingerprint

    monkeypatch.setattr(fingerprint, "HASH_RANGE_BYTES", 50)
    path = tmp_path / "in.jsonl"
    path.write_bytes(TRICKY)
    for range_bytes in (1, 13, 49, 50, 51, 120):
        assert pieced_rows(path, range_bytes) == whole_rows(path), range_bytes


def test_directory_fingerprint_from_ranges_matches_one_pass(tmp_path: Path):
    shards = tmp_path / "in"
    shards.mkdir()
    (shards / "a.jsonl").write_bytes(b'{"custom_id": "a"}\n' * 20)
    (shards / "b.jsonl").write_bytes(b'{"custom_id": "b"}\n' * 3)
    source = input_source(str(shards))
    _, scans = source.plan_reads(1 << 20)
    stats = ReadStats()
    list(source.rows(stats))
    assert source.local_fingerprint(scans, [source.scan(r)[1] for r in scans]) == stats.fingerprint


def test_iter_jsonl_stops_after_the_line_that_crosses_the_end():
    import io

    data = b"aaaa\nbbbb\ncccc\n"
    stream = io.BufferedReader(io.BytesIO(data))  # type: ignore[arg-type]
    stream.seek(5)
    rows = list(iter_jsonl(stream, "s", first_number=2, start=5, end=6))
    assert rows == [("s", 2, b"bbbb")]


@pytest.mark.parametrize(
    "size,expected", [(0, [(0, 0)]), (10, [(0, 10)]), (25, [(0, 10), (10, 20), (20, 25)])]
)
def test_file_ranges(size, expected):
    assert file_ranges(size, 10) == expected


@pytest.mark.parametrize("table_read", [False, True])
def test_a_streamed_parquet_inputs_first_pieces_are_slices_of_its_row_groups(
    tmp_path: Path, table_read: bool
):
    """A streamed job's first pieces are small (`lead`): a Parquet file's first row groups are cut into slices of
    rows, so its first requests reach the engines without waiting for a whole run of row groups. Every slicing reads
    exactly the rows, numbers and values of one pass, as a request file or as a dataset's table."""
    from pipeline.io.pieces import sliced_runs
    from pipeline.io.rows import TableRead

    path = tmp_path / "in.parquet"
    table = pa.table(
        {
            "custom_id": [f"r{i}" for i in range(100)],
            "url": ["/v1/completions"] * 100,
            "body": [f'{{"prompt": "p{i}"}}' for i in range(100)],
        }
    )
    pq.write_table(table, path, row_group_size=30)  # groups of 30, 30, 30, 10
    assert sliced_runs([(0, 2, 0), (2, 4, 60)], 100, [8, 8, 16, 32]) == [
        (0, 2, 0, 0, 8),
        (0, 2, 0, 8, 8),
        (0, 2, 0, 16, 16),
        (0, 2, 0, 32, None),  # 28 rows left: less than the next slice, the run's rest
        (2, 4, 60, 0, 32),
        (2, 4, 60, 32, None),
    ]
    source = input_source(str(path))
    if table_read:
        source.table = TableRead(None, ("custom_id", "body"))
    reference = [(s, n, dict(r)) for s, n, r in source.rows()]
    for lead in ((), (512 * 5,), (512 * 7,) * 3 + (512 * 50,), (512,) * 200):
        pieces, _ = source.plan_reads(piece_rows=60, lead=lead)
        rows = [(s, n, dict(r)) for p in pieces for s, n, r in source.piece_rows(p)]
        assert rows == reference, lead
        assert [n for _, n, _ in rows] == list(range(1, 101))
    pieces, _ = source.plan_reads(piece_rows=60, lead=(512 * 5,) * 2)
    assert [(p.start, p.end, p.before, p.skip, p.take) for p in pieces] == [
        (0, 2, 0, 0, 5),
        (0, 2, 0, 5, 5),
        (0, 2, 0, 10, None),
        (2, 4, 60, 0, None),
    ]
