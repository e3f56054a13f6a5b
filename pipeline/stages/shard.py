"""Sort and range-partition finished rows into shards. Pure: the caller supplies the rows and a sink per shard.

`write_shard` writes one sorted Arrow table through a shard encoder (JSONL here, Parquet in `pipeline.io.writers`);
`write_table_shards` does it for a sequence of tables, one per shard.

Shard k holds rows [k*rows_per_shard, (k+1)*rows_per_shard) of the sorted output, so the last id of shard k precedes
the first id of shard k+1. Every shard's sha256 and byte count are taken from the bytes as they are written.

The range partitioning works on one binary sort key per row (`sort_keys`), compared bytewise (as Arrow orders binary
and Python orders bytes): `splitters` cuts a sample of keys into buckets, `locate_cuts` finds the bucket and the offset
in it of each exact shard boundary from per-bucket row counts, and `assign_shards` routes rows by boundary keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.io.encoders import HashingSink, JsonlEncoder, ShardEncoder, ShardInfo

# How finished rows are ordered: results by custom_id (UTF-8 byte order, which is also Python's str order and
# Arrow's string order), error records by source position.
# A dataset job's table (answers and errors together) and its kept input rows: by id, then by source position (two
# rows of one id — a duplicate and the row it repeats — each keep a place of their own).
_BY_ID_THEN_POSITION = [("custom_id", "ascending"), ("source", "ascending"), ("line", "ascending")]
SORT_KEYS: dict[str, list[tuple[str, str]]] = {
    "results": [("custom_id", "ascending")],
    "errors": [("source", "ascending"), ("line", "ascending")],
    "table": _BY_ID_THEN_POSITION,
    "rows": _BY_ID_THEN_POSITION,
}


def shard_count(total_rows: int, rows_per_shard: int) -> int:
    # An empty output still gets one (empty) shard, so readers can always open `*-00000-of-*`.
    return max(1, -(-total_rows // rows_per_shard))


def shard_name(prefix: str, index: int, count: int, extension: str) -> str:
    return f"{prefix}-{index:05d}-of-{count:05d}.{extension}"


def write_shard(
    table: pa.Table,
    name: str,
    open_shard: Callable[[str], BinaryIO],
    encoder: Callable[[HashingSink], ShardEncoder] = JsonlEncoder,
    ids: pa.ChunkedArray | pa.Array | None = None,
) -> ShardInfo:
    """Write one sorted table as the shard `name`; its rows, first/last custom_id, sha256 and size come back.
    `ids`: the rows' custom_ids, when the table written does not carry them (a dataset job's table).

    An empty table makes an empty shard (no bytes in JSONL; a Parquet file with the schema and no row groups)."""
    info = ShardInfo(name, rows=table.num_rows)
    if table.num_rows:
        ids = table.column("custom_id") if ids is None else ids
        info.first_custom_id, info.last_custom_id = ids[0].as_py(), ids[-1].as_py()
    enc = encoder(HashingSink(open_shard(name), info))
    enc.write_table(table)
    enc.close()
    return info


def write_table_shards(
    tables: Iterable[pa.Table],
    total_rows: int,
    rows_per_shard: int,
    prefix: str,
    open_shard: Callable[[str], BinaryIO],
    encoder: Callable[[HashingSink], ShardEncoder] = JsonlEncoder,
    extension: str = "jsonl",
) -> list[ShardInfo]:
    """Write one sorted table per shard (each `rows_per_shard` rows, the last one the rest) through `encoder`.

    Tables need a `record` column (the output line, JSON) and `custom_id`.
    """
    count = shard_count(total_rows, rows_per_shard)
    shards: list[ShardInfo] = []
    written = 0
    for table in tables:
        expected = min(rows_per_shard, total_rows - written)
        if table.num_rows != expected or len(shards) >= count:
            raise RuntimeError(
                f"{prefix}: shard {len(shards)} has {table.num_rows} rows, expected {expected} (of {total_rows})"
            )
        name = shard_name(prefix, len(shards), count, extension)
        shards.append(write_shard(table, name, open_shard, encoder))
        written += table.num_rows
    if written != total_rows:
        raise RuntimeError(f"{prefix}: expected {total_rows} rows from staging, merged {written}")

    def write_empty(sink: HashingSink) -> None:
        enc = encoder(sink)
        enc.write_table(
            pa.table({"custom_id": pa.array([], pa.string()), "record": pa.array([], pa.string())})
        )
        enc.close()

    _pad_empty(shards, count, prefix, extension, open_shard, write_empty)
    return shards


def _pad_empty(
    shards: list[ShardInfo],
    count: int,
    prefix: str,
    extension: str,
    open_shard: Callable[[str], BinaryIO],
    fill: Callable[[HashingSink], None],
) -> None:
    while len(shards) < count:  # only when total_rows == 0
        empty = ShardInfo(shard_name(prefix, len(shards), count, extension))
        sink = HashingSink(open_shard(empty.name), empty)
        fill(sink)
        sink.close()
        shards.append(empty)


# -- sorting and range partitioning of Arrow tables --------------------------------------------------------------------


def sort_table(table: pa.Table, kind: str) -> pa.Table:
    """Rows in final order: results by custom_id, errors by (source, line). Arrow compares strings bytewise."""
    if table.num_rows <= 1:
        return table
    return table.take(pc.sort_indices(table, sort_keys=SORT_KEYS[kind]))


def first_duplicate(sorted_ids: pa.Array | pa.ChunkedArray) -> str | None:
    """The first custom_id that appears twice in an already sorted column, if any."""
    if len(sorted_ids) < 2:
        return None
    ids = sorted_ids.combine_chunks() if isinstance(sorted_ids, pa.ChunkedArray) else sorted_ids
    same = pc.equal(ids.slice(1), ids.slice(0, len(ids) - 1))
    hit = pc.index(same, True).as_py()
    return None if hit < 0 else ids[hit].as_py()


def sort_keys(table: pa.Table, kind: str) -> pa.Array:
    """One binary key per row whose bytewise order is the final order of `sort_table`.

    Results: the custom_id's UTF-8 bytes. Errors: the source's bytes, a NUL, then the line as 8 big-endian bytes with
    the sign bit flipped (so negative lines sort first). A null sorts last, as in `sort_table`: 0xFF never occurs in
    UTF-8, and a null line becomes the largest line.
    """
    if kind == "results":
        ids = pc.cast(table.column("custom_id"), pa.binary()).fill_null(b"\xff")
        return ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    source = pc.cast(table.column("source"), pa.binary()).fill_null(b"\xff")
    lines = table.column("line").fill_null(np.iinfo(np.int64).max).to_numpy(zero_copy_only=False)
    flipped = (lines.astype(np.int64).view(np.uint64) ^ np.uint64(1 << 63)).astype(">u8")
    line_bytes = pa.Array.from_buffers(pa.binary(8), len(flipped), [None, pa.py_buffer(flipped.tobytes())])
    keys = pc.binary_join_element_wise(source, line_bytes.cast(pa.binary()), b"\x00")
    if kind in ("table", "rows"):
        # The id, a NUL, then the position: ids hold no NUL (a custom_id with control characters is refused), so
        # an id that is a prefix of another still sorts first.
        ids = pc.cast(table.column("custom_id"), pa.binary()).fill_null(b"\xff")
        keys = pc.binary_join_element_wise(ids, keys, b"\x00")
    return keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys


def evenly_spaced(values: pa.Array, n: int) -> pa.Array:
    """At most `n` values picked at even steps (all of them when there are fewer)."""
    if len(values) <= n:
        return values
    return values.take(pa.array(np.linspace(0, len(values) - 1, n).round().astype(np.int64)))


def splitters(sample: pa.Array, buckets: int) -> pa.Array:
    """Keys that cut a sample into `buckets` parts of about equal size: bucket b holds keys in [s[b-1], s[b]).
    Fewer when the sample has fewer distinct keys; none for one bucket or an empty sample."""
    if buckets <= 1 or not len(sample):
        return pa.array([], pa.binary())
    ordered = sample.take(pc.sort_indices(sample))
    picks = [ordered[len(ordered) * b // buckets].as_py() for b in range(1, buckets)]
    return pa.array(sorted(set(picks)), pa.binary())


def assign_shards(keys: pa.Array, boundaries: pa.Array) -> np.ndarray:
    """For every key, how many boundaries are <= it (numpy's searchsorted(..., side="right")): its shard index.

    A bisection over the boundaries for all keys at once, each step one vectorised Arrow comparison (bytewise), so a
    row costs no Python object."""
    n, m = len(keys), len(boundaries)
    lo = np.zeros(n, dtype=np.int64)
    if not m or not n:
        return lo
    hi = np.full(n, m, dtype=np.int64)
    while (active := lo < hi).any():
        mid = (lo + hi) // 2
        probe = boundaries.take(pa.array(np.minimum(mid, m - 1)))
        at_or_above = pc.greater_equal(keys, probe).to_numpy(zero_copy_only=False)
        lo = np.where(active & at_or_above, mid + 1, lo)
        hi = np.where(active & ~at_or_above, mid, hi)
    return lo


def cut_ranks(total_rows: int, rows_per_shard: int) -> list[int]:
    """The sorted position of each shard's first row, shards 1..n-1."""
    return [k * rows_per_shard for k in range(1, shard_count(total_rows, rows_per_shard))]


def locate_cuts(bucket_rows: Sequence[int], cuts: Sequence[int]) -> dict[int, list[int]]:
    """Where each cut (a sorted position over all buckets, in order) falls: {bucket: [offsets inside it]}."""
    found: dict[int, list[int]] = {}
    start, bucket = 0, 0
    for cut in cuts:
        while bucket < len(bucket_rows) and cut >= start + bucket_rows[bucket]:
            start += bucket_rows[bucket]
            bucket += 1
        if bucket == len(bucket_rows):
            raise ValueError(f"cut at row {cut} is past the last row ({start})")
        found.setdefault(bucket, []).append(cut - start)
    return found


def group_parts(part_rows: Sequence[int], target_rows: int) -> list[list[int]]:
    """Consecutive runs of parts (by index) of about `target_rows` rows each; every part in exactly one group."""
    groups: list[list[int]] = []
    rows = 0
    for index, n in enumerate(part_rows):
        if not groups or rows >= target_rows:
            groups.append([])
            rows = 0
        groups[-1].append(index)
        rows += n
    return groups


def split_by_shard(table: pa.Table, shard_of_row: Sequence[int] | np.ndarray) -> dict[int, pa.Table]:
    """Group the rows of `table` by shard index (row order within a group kept)."""
    shard_of_row = np.asarray(shard_of_row)
    if not len(shard_of_row):
        return {}
    first = int(shard_of_row[0])
    if (shard_of_row == first).all():
        return {first: table}
    order = np.argsort(shard_of_row, kind="stable")
    ordered = table.take(pa.array(order))
    shards, starts = np.unique(shard_of_row[order], return_index=True)
    ends = list(starts[1:]) + [len(order)]
    return {int(s): ordered.slice(int(a), int(b - a)) for s, a, b in zip(shards, starts, ends, strict=True)}


def as_manifest(shards: Iterable[ShardInfo]) -> list[dict[str, Any]]:
    return [s.as_manifest() for s in shards]
