"""A dataset job's input rows, staged at ingest beside its requests, for finalize to join with their answers.

Each staged row is `custom_id`, `source`, `line` (the same three its answer or error record is staged with, so the
two meet in one shard and sort side by side) and `row`, the columns the output keeps:
- a struct of the table's own types when the input is Parquet (a timestamp stays a timestamp);
- the row's JSON text when the input is JSONL (objects of one file may disagree on a column's type; the output
  writes them back as they were, or lets Arrow type them for a Parquet output).

Pure: pyarrow, no Ray.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from pipeline import json_codec

KEY_FIELDS = [
    pa.field("custom_id", pa.string()),
    pa.field("source", pa.string()),
    pa.field("line", pa.int64()),
]


def kept_struct(schema: pa.Schema, keep: list[str] | None) -> pa.DataType:
    """The `row` type of a Parquet table's kept columns."""
    names = schema.names if keep is None else keep
    return pa.struct([schema.field(name) for name in names])


class KeptRows:
    """The kept rows one read task stages, a part at a time."""

    def __init__(self, row_type: pa.DataType | None) -> None:
        self.row_type = row_type  # None: JSON text (a JSONL input)
        self.rows: list[tuple[str | None, str, int, Any]] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, custom_id: str | None, source: str, line: int, row: dict[str, Any] | None) -> None:
        if self.row_type is None and row is not None:
            row = json_codec.dumps(row)
        self.rows.append((custom_id, source, line, row))

    def table(self) -> pa.Table:
        ids, sources, lines, rows = zip(*self.rows, strict=True) if self.rows else ([], [], [], [])
        row_type = self.row_type or pa.string()
        schema = pa.schema([*KEY_FIELDS, pa.field("row", row_type)])
        return pa.table(
            [list(ids), list(sources), list(lines), pa.array(list(rows), row_type)], schema=schema
        )

    def clear(self) -> None:
        self.rows = []
