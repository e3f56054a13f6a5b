"""Range-partition sorted rows into shards. Pure: the caller supplies the rows (already in order) and a sink."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import BinaryIO


def shard_count(total_rows: int, rows_per_shard: int) -> int:
    # An empty output still gets one (empty) shard, so readers can always open `*-00000-of-*`.
    return max(1, -(-total_rows // rows_per_shard))


def shard_name(prefix: str, index: int, count: int, extension: str) -> str:
    return f"{prefix}-{index:05d}-of-{count:05d}.{extension}"


@dataclass
class ShardInfo:
    name: str
    rows: int = 0
    first_custom_id: str | None = None
    last_custom_id: str | None = None
    bytes: int = 0
    sha256: str = ""
    _hash: object = field(default_factory=hashlib.sha256, repr=False)

    def as_manifest(self) -> dict:
        return {
            "name": self.name,
            "rows": self.rows,
            "first_custom_id": self.first_custom_id,
            "last_custom_id": self.last_custom_id,
            "bytes": self.bytes,
            "sha256": self.sha256,
        }


def write_shards(
    rows: Iterable[tuple[str | None, str]],
    total_rows: int,
    rows_per_shard: int,
    prefix: str,
    open_shard: Callable[[str], BinaryIO],
    extension: str = "jsonl",
) -> list[ShardInfo]:
    """Write (custom_id, json line) pairs, in order, into `shard_count` consecutive JSONL shards.

    Range partitioning falls out of writing sorted rows sequentially: shard k holds rows
    [k*rows_per_shard, (k+1)*rows_per_shard), so the last id of shard k precedes the first id of shard k+1.
    """
    count = shard_count(total_rows, rows_per_shard)
    shards: list[ShardInfo] = []
    written = 0
    handle: BinaryIO | None = None
    current: ShardInfo | None = None

    def close_current() -> None:
        if handle is not None and current is not None:
            handle.close()
            current.sha256 = current._hash.hexdigest()  # type: ignore[attr-defined]

    for custom_id, line in rows:
        if current is None or current.rows == rows_per_shard:
            close_current()
            current = ShardInfo(shard_name(prefix, len(shards), count, extension))
            shards.append(current)
            handle = open_shard(current.name)
        data = (line + "\n").encode()
        handle.write(data)  # type: ignore[union-attr]
        current._hash.update(data)  # type: ignore[attr-defined]
        current.bytes += len(data)
        current.rows += 1
        if current.first_custom_id is None:
            current.first_custom_id = custom_id
        current.last_custom_id = custom_id
        written += 1
    close_current()
    if written != total_rows:
        # The staged counts and the merged stream disagree: never commit such an output.
        raise RuntimeError(f"{prefix}: expected {total_rows} rows from staging, merged {written}")
    while len(shards) < count:  # only when total_rows == 0
        empty = ShardInfo(shard_name(prefix, len(shards), count, extension))
        open_shard(empty.name).close()
        empty.sha256 = hashlib.sha256().hexdigest()
        shards.append(empty)
    return shards
