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
from pipeline.io.rows import TableRow

KEY_FIELDS = [
    pa.field("custom_id", pa.string()),
    pa.field("source", pa.string()),
    pa.field("line", pa.int64()),
]


def kept_struct(schema: pa.Schema, keep: list[str] | None) -> pa.DataType:
    """The `row` type of a Parquet table's kept columns."""
    names = schema.names if keep is None else keep
    return pa.struct([schema.field(name) for name in names])


def _values(row: Any, names: list[str] | None) -> Any:
    """A row's kept values (`names`, or all) as Python: a TableRow's from its batch (it holds only the rendered
    ones itself)."""
    if isinstance(row, TableRow):
        row = row.batch.slice(row.index, 1).to_pylist()[0]
    if row is None or names is None:
        return row
    return {name: row.get(name) for name in names}


class KeptRows:
    """The kept rows one read task stages, a part at a time."""

    def __init__(self, row_type: pa.DataType | None, keep: list[str] | None = None) -> None:
        self.row_type = row_type  # None: JSON text (a JSONL input)
        # The kept columns (None: all): a struct type names them; JSON text keeps these of each row.
        self.keep = [field.name for field in row_type] if row_type is not None else keep
        self.rows: list[tuple[str | None, str, int, Any]] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, custom_id: str | None, source: str, line: int, row: dict[str, Any] | None) -> None:
        if self.row_type is None and row is not None:
            row = json_codec.dumps(_values(row, self.keep))
        self.rows.append((custom_id, source, line, row))

    def table(self) -> pa.Table:
        ids, sources, lines, rows = zip(*self.rows, strict=True) if self.rows else ([], [], [], [])
        row_type = self.row_type or pa.string()
        schema = pa.schema([*KEY_FIELDS, pa.field("row", row_type)])
        return pa.table(
            [list(ids), list(sources), list(lines), self._row_array(rows, row_type)], schema=schema
        )

    def _row_array(self, rows: tuple, row_type: pa.DataType) -> pa.Array:
        """The kept rows as one array: Parquet rows (TableRow) sliced from their Arrow batches, run by run, without
        a Python value in between; any other row converted from its values."""
        if self.row_type is None:  # JSON text, made as each row was added
            return pa.array(list(rows), row_type)
        if not rows or not all(isinstance(row, TableRow) for row in rows):
            return pa.array([_values(row, self.keep) for row in rows], row_type)
        names = self.keep
        if not names:  # no column kept: an empty struct per row
            return pa.array([{}] * len(rows), row_type)
        structs: dict[int, pa.StructArray] = {}
        pieces = []
        start = 0
        for end in range(1, len(rows) + 1):
            first, last = rows[start], rows[end - 1]
            if end < len(rows):
                nxt = rows[end]
                if nxt.batch is last.batch and nxt.index == last.index + 1:
                    continue
            batch = first.batch
            if id(batch) not in structs:
                structs[id(batch)] = pa.StructArray.from_arrays(
                    [batch.column(name) for name in names], fields=list(row_type)
                )
            pieces.append(structs[id(batch)].slice(first.index, last.index - first.index + 1))
            start = end
        return pa.concat_arrays(pieces)

    def clear(self) -> None:
        self.rows = []
