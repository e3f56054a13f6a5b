"""Shard encoders: finished rows (the staged `record` column, one complete output line each) written to a byte sink
that hashes and counts what passes through, so every shard's sha256 and size come from the bytes as written.
JSONL here; Parquet in `pipeline.io.writers`."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

WRITE_BATCH_ROWS = 16_384


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


class HashingSink:
    """A write-only file that forwards to `target` and keeps the sha256 and size of everything written."""

    def __init__(self, target: BinaryIO, info: ShardInfo) -> None:
        self._target = target
        self._info = info
        self.closed = False

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._info._hash.update(view)  # type: ignore[attr-defined]
        self._info.bytes += view.nbytes
        self._target.write(view)
        return view.nbytes

    def tell(self) -> int:
        return self._info.bytes

    def flush(self) -> None:
        self._target.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._target.close()
            self._info.sha256 = self._info._hash.hexdigest()  # type: ignore[attr-defined]


class ShardEncoder(Protocol):
    def write_table(self, table: pa.Table) -> None: ...

    def close(self) -> None: ...


def string_bytes(array: pa.Array) -> memoryview:
    """The bytes of a string/binary array's values, back to back (no copy)."""
    large = pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type)
    width = 8 if large else 4
    _, offsets_buffer, data = array.buffers()
    if data is None or not len(array):
        return memoryview(b"")
    offsets = np.frombuffer(
        offsets_buffer,
        dtype=np.int64 if large else np.int32,
        count=len(array) + 1,
        offset=array.offset * width,
    )
    return memoryview(data)[int(offsets[0]) : int(offsets[-1])]


class JsonlEncoder:
    """JSONL shards: the staged `record` column, one line per row — joined in Arrow, no Python object per row."""

    extension = "jsonl"

    def __init__(self, sink: HashingSink) -> None:
        self._sink = sink

    def write_table(self, table: pa.Table) -> None:
        records = table.column("record")
        if records.null_count:
            raise ValueError("a staged row has no output record")
        for start in range(0, table.num_rows, WRITE_BATCH_ROWS):
            lines = pc.binary_join_element_wise(records.slice(start, WRITE_BATCH_ROWS), "", "\n")
            for chunk in lines.chunks:
                self._sink.write(string_bytes(chunk))

    def close(self) -> None:
        self._sink.close()
