"""One input file: where it is, what its listing says of it, which format it holds, and its rows.

The format comes from the file name (`.parquet`/`.pq`/`.parq`, else the JSONL suffixes), else from the Parquet
magic bytes, else JSONL. Files whose name starts with `.` or `_` are never inputs (a directory's or prefix's
bookkeeping, e.g. `_SUCCESS`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.config import InputLimits
from pipeline.io.jsonl import JSONL_SUFFIXES, iter_jsonl, maybe_gunzip
from pipeline.io.parquet import PARQUET_MAGIC, PARQUET_SUFFIXES, iter_parquet, iter_table_parquet
from pipeline.io.rows import Row, TableRead

INPUT_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES


@dataclass(frozen=True)
class InputFile:
    name: str  # shown as `source` in error records: the path or URL
    ref: str  # local path, s3 "bucket/key", or URL
    size: int | None = None
    etag: str | None = None
    last_modified: str | None = None

    @property
    def declared_format(self) -> str | None:
        lowered = self.ref.split("?", 1)[0].lower()
        if lowered.endswith(PARQUET_SUFFIXES):
            return "parquet"
        if lowered.endswith(JSONL_SUFFIXES):
            return "jsonl"
        return None


def is_hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def sniffed_format(head: bytes) -> str:
    """The format of a file whose name declares none, from its first bytes."""
    return "parquet" if head[:4] == PARQUET_MAGIC else "jsonl"


def iter_rows(
    handle: Any,
    file: InputFile,
    fmt: str,
    limits: InputLimits,
    row_groups: Sequence[int] | None = None,
    first_number: int = 1,
    table: TableRead | None = None,
    rows: tuple[int, int | None] = (0, None),
) -> Iterator[Row]:
    """The rows of `file` in format `fmt`, from `handle`: for Parquet a path or a seekable file object (only
    `row_groups`, of their rows `rows` = (skipped, taken or None), the first numbered `first_number`, when given),
    for JSONL a stream (gunzipped here when the file's name ends in `.gz`). `table`: read as a dataset job's table
    (io/rows.TableRead)."""
    if fmt == "parquet" and table is not None:
        return iter_table_parquet(
            handle,
            file.name,
            table.columns,
            row_groups=row_groups,
            first_number=first_number,
            rendered=table.rendered,
            rows=rows,
        )
    if fmt == "parquet":
        return iter_parquet(
            handle,
            file.name,
            max_line_bytes=limits.max_line_bytes,
            max_json_depth=limits.max_json_depth,
            row_groups=row_groups,
            first_number=first_number,
            rows=rows,
        )
    return iter_jsonl(
        maybe_gunzip(handle, file.ref, limits.max_decompressed_bytes), file.name, limits.max_line_bytes
    )
