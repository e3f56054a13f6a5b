"""stages.finalize: write_table_shards (shard names, per-shard rows / ids / sha256, empty output) and the range
partitioning helpers (sort keys, boundaries from a sample, exact cuts, routing rows by boundary)."""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import random
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.stages.shard import (
    assign_shards,
    cut_ranks,
    group_parts,
    locate_cuts,
    shard_count,
    shard_name,
    sort_keys,
    sort_table,
    splitters,
    write_table_shards,
)


def write_shards(rows, total_rows: int, rows_per_shard: int, prefix: str, open_shard):
    """(custom_id, JSON line) pairs in final order, cut into one table per shard as finalize's sort hands them over."""
    rows = list(rows)
    tables = [
        pa.table(
            {
                "custom_id": pa.array([cid for cid, _ in rows[i : i + rows_per_shard]], pa.string()),
                "record": pa.array([line for _, line in rows[i : i + rows_per_shard]], pa.string()),
            }
        )
        for i in range(0, len(rows), rows_per_shard)
    ]
    return write_table_shards(tables, total_rows, rows_per_shard, prefix, open_shard)


class MemorySink:
    """open_shard for tests: keeps every shard's bytes, records open/close order."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.opened: list[str] = []
        self.closed: list[str] = []

    def __call__(self, name: str):
        sink = self

        class _Shard(io.BytesIO):
            def close(self) -> None:
                if not self.closed:
                    sink.files[name] = self.getvalue()
                    sink.closed.append(name)
                super().close()

        assert name not in self.opened, f"{name} opened twice"
        self.opened.append(name)
        return _Shard()


def rows_for(ids: list[str]) -> list[tuple[str, str]]:
    return [(cid, json.dumps({"custom_id": cid, "n": i}, ensure_ascii=False)) for i, cid in enumerate(ids)]


def test_shard_count_and_name():
    assert [shard_count(n, 3) for n in (0, 1, 3, 4, 9, 10)] == [1, 1, 1, 2, 3, 4]
    assert shard_name("results", 2, 4, "jsonl") == "results-00002-of-00004.jsonl"


def test_range_partition_across_shard_boundaries():
    ids = [f"id-{i:03d}" for i in range(10)]
    rows = rows_for(ids)
    sink = MemorySink()
    shards = write_shards(iter(rows), 10, 3, "results", sink)

    names = [f"results-{k:05d}-of-00004.jsonl" for k in range(4)]
    assert [s.name for s in shards] == names
    assert sink.opened == names and sink.closed == names  # each shard opened once, closed, in order
    assert [s.rows for s in shards] == [3, 3, 3, 1]
    for k in range(len(shards) - 1):
        assert shards[k].last_custom_id < shards[k + 1].first_custom_id

    concatenated = b""
    for k, shard in enumerate(shards):
        data = sink.files[shard.name]
        concatenated += data
        expected_ids = ids[3 * k : 3 * k + 3]
        lines = data.decode().splitlines()
        assert data.endswith(b"\n")
        assert [json.loads(x)["custom_id"] for x in lines] == expected_ids
        assert shard.rows == len(lines)
        assert (shard.first_custom_id, shard.last_custom_id) == (expected_ids[0], expected_ids[-1])
        assert shard.sha256 == hashlib.sha256(data).hexdigest()
        assert shard.bytes == len(data)
        assert shard.as_manifest() == {
            "name": shard.name,
            "rows": shard.rows,
            "first_custom_id": expected_ids[0],
            "last_custom_id": expected_ids[-1],
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    assert concatenated == "".join(line + "\n" for _, line in rows).encode()


@pytest.mark.parametrize(
    "total, per_shard, expected_rows", [(9, 3, [3, 3, 3]), (3, 10, [3]), (1, 1, [1]), (5, 1, [1] * 5)]
)
def test_exact_and_single_shard_sizes(total, per_shard, expected_rows):
    sink = MemorySink()
    shards = write_shards(rows_for([f"{i:04d}" for i in range(total)]), total, per_shard, "errors", sink)
    assert [s.rows for s in shards] == expected_rows
    count = len(expected_rows)
    assert [s.name for s in shards] == [f"errors-{k:05d}-of-{count:05d}.jsonl" for k in range(count)]
    assert sum(s.bytes for s in shards) == sum(len(v) for v in sink.files.values())


def test_empty_output_is_one_empty_shard():
    sink = MemorySink()
    shards = write_shards(iter(()), 0, 3, "results", sink)
    assert [s.name for s in shards] == ["results-00000-of-00001.jsonl"]
    assert sink.files == {"results-00000-of-00001.jsonl": b""}
    shard = shards[0]
    assert (shard.rows, shard.bytes, shard.first_custom_id, shard.last_custom_id) == (0, 0, None, None)
    assert shard.sha256 == hashlib.sha256(b"").hexdigest()


def test_empty_output_on_disk(tmp_path: Path):
    def open_shard(name: str):
        return open(tmp_path / name, "wb")

    write_shards([], 0, 100, "errors", open_shard)
    assert [p.name for p in tmp_path.iterdir()] == ["errors-00000-of-00001.jsonl"]
    assert (tmp_path / "errors-00000-of-00001.jsonl").read_bytes() == b""


@pytest.mark.parametrize("given, expected", [(4, 5), (6, 5), (0, 2), (2, 0)])
def test_count_mismatch_raises(given, expected):
    with pytest.raises(RuntimeError, match=rf"expected {expected} rows|\(of {expected}\)"):
        write_shards(rows_for([f"{i}" for i in range(given)]), expected, 3, "results", MemorySink())


def test_unicode_ids_in_utf8_byte_order():
    # Chosen so that code-point/UTF-8 order differs from UTF-16 order (U+FFFF vs U+1F600) and from locale order.
    ids = [
        "z",
        "Z",
        "é",
        "e",
        "\uffff",
        "😀",
        "\U00010000",
        "ä",
        "ａ",
        "日本",
        "a-1",
        "a_1",
        "A",
        "\u00a0",
        "~",
    ]
    utf8_sorted = sorted(ids, key=lambda s: s.encode("utf-8"))
    assert utf8_sorted == sorted(ids)  # Python str order is UTF-8 byte order
    assert utf8_sorted != sorted(ids, key=lambda s: s.encode("utf-16-be"))  # the example discriminates

    sink = MemorySink()
    shards = write_shards(rows_for(utf8_sorted), len(ids), 4, "results", sink)
    written = [
        json.loads(x)["custom_id"] for s in shards for x in sink.files[s.name].decode("utf-8").splitlines()
    ]
    assert written == utf8_sorted
    for k in range(len(shards) - 1):
        assert shards[k].last_custom_id.encode() < shards[k + 1].first_custom_id.encode()
    for shard in shards:
        assert shard.sha256 == hashlib.sha256(sink.files[shard.name]).hexdigest()
    assert "😀" in sink.files[shards[-1].name].decode("utf-8")  # non-ASCII written as UTF-8, not escaped


# -- range partitioning by sort key -----------------------------------------------------------------------------------


def test_sort_keys_order_is_the_final_order():
    ids = ["b", "a", "😀", "\uffff", "é", "a-1", "A", "日本", "a\x00"]
    results = pa.table({"custom_id": ids})
    keys = sort_keys(results, "results").to_pylist()
    assert [ids[i] for i in sorted(range(len(ids)), key=keys.__getitem__)] == sort_table(
        results, "results"
    ).column("custom_id").to_pylist()

    # A source that is a prefix of another, negative and large lines, null sources and lines: still sort_table's order.
    sources = ["ab", "a", "a", "b", None, "a", "ab", None, "a/b"]
    lines = [1, 2**40, -3, 0, 5, None, 7, None, 1]
    errors = pa.table({"source": pa.array(sources, pa.string()), "line": pa.array(lines, pa.int64())})
    keys = sort_keys(errors, "errors").to_pylist()
    by_key = sorted(range(len(sources)), key=keys.__getitem__)
    expected = sort_table(errors.append_column("i", pa.array(range(len(sources)))), "errors").column("i")
    assert by_key == expected.to_pylist()


@pytest.mark.parametrize("n_boundaries", [0, 1, 2, 7, 64])
def test_assign_shards_is_searchsorted_right(n_boundaries):
    rng = random.Random(n_boundaries)
    keys = [bytes(rng.randrange(256) for _ in range(rng.randint(0, 4))) for _ in range(500)]
    boundaries = sorted(
        {bytes(rng.randrange(256) for _ in range(rng.randint(1, 3))) for _ in range(n_boundaries)}
    )
    keys += boundaries  # keys equal to a boundary go to the shard that boundary starts
    got = assign_shards(pa.array(keys, pa.binary()), pa.array(boundaries, pa.binary()))
    assert got.tolist() == [bisect.bisect_right(boundaries, k) for k in keys]


def test_splitters_cut_a_sample_into_equal_buckets():
    sample = pa.array([f"{i:04d}".encode() for i in range(1000)][::-1], pa.binary())
    assert splitters(sample, 4).to_pylist() == [b"0250", b"0500", b"0750"]
    assert splitters(sample, 1).to_pylist() == [] and splitters(sample[:0], 4).to_pylist() == []
    assert splitters(pa.array([b"x"] * 10, pa.binary()), 4).to_pylist() == [b"x"]  # fewer when keys repeat


def test_locate_cuts_and_cut_ranks():
    assert cut_ranks(10, 3) == [3, 6, 9] and cut_ranks(9, 3) == [3, 6] and cut_ranks(0, 3) == []
    # buckets of 4, 0, 5, 1 rows: rows 0-3 | - | 4-8 | 9
    assert locate_cuts([4, 0, 5, 1], [3, 6, 9]) == {0: [3], 2: [2], 3: [0]}
    assert locate_cuts([4, 0, 5, 1], [4]) == {2: [0]}  # a cut on a bucket's first row skips the empty bucket
    with pytest.raises(ValueError):
        locate_cuts([2], [2])


def test_group_parts_keeps_every_part_once_in_order():
    assert group_parts([], 10) == []
    assert group_parts([4, 4, 4, 4, 30, 1], 10) == [[0, 1, 2], [3, 4], [5]]
    assert group_parts([100], 10) == [[0]]
