"""A dataset job's output: every input row once, its kept columns and its answer, in one table.

    table = answered_table(rows, records, TableOutput("chat"))   # rows: the kept rows; records: their output lines
    encoder = table_encoder("parquet")(sink)          # or "jsonl": one JSON object per row

The answer columns depend on the route: `content` and `finish_reason` for the generating routes, `embedding` (a list
of float32) for embeddings, `score` for score; every route adds `prompt_tokens`, `completion_tokens` and `error`
(`{code, message}`, null when the row was answered): a row the engine refused and a row that never became a request
(a template it could not render, a null id) both carry theirs there.

Pure: pyarrow, no Ray.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import json_codec
from pipeline.datasets.json_columns import answer_schema, arrow_type, parsed_column
from pipeline.datasets.spec import DatasetConfig
from pipeline.endpoints import endpoint_answering, endpoint_named
from pipeline.io.encoders import HashingSink

WRITE_BATCH_ROWS = 8192
ERROR_TYPE = pa.struct([pa.field("code", pa.string()), pa.field("message", pa.string())])
_ROUTE_COLUMNS: dict[str, list[pa.Field]] = {
    "text": [pa.field("content", pa.string()), pa.field("finish_reason", pa.string())],
    "embeddings": [pa.field("embedding", pa.list_(pa.float32()))],
    "score": [pa.field("score", pa.float64())],
}
_COMMON_COLUMNS = [
    pa.field("prompt_tokens", pa.int64()),
    pa.field("completion_tokens", pa.int64()),
    pa.field("error", ERROR_TYPE),
]


@dataclass(frozen=True)
class TableOutput:
    """What finalize needs to write a dataset job's table: the answer columns of its route, and how a JSON answer
    is parsed (datasets/json_columns.py)."""

    route: str
    json_output: str | None = None  # "struct" or "columns"
    json_schema: dict[str, Any] | None = None

    @classmethod
    def of(cls, spec: DatasetConfig) -> TableOutput:
        schema = answer_schema(spec.sampling()) if spec.json_output else None
        return cls(spec.route, spec.json_output, schema)

    def answer_names(self) -> list[str]:
        names = [field.name for field in answer_fields(self.route)]
        if self.json_output == "struct":
            return [*names, "parsed"]
        if self.json_output == "columns":
            kind = arrow_type(self.json_schema)
            if kind is not None and pa.types.is_struct(kind):
                return [*names, *(kind.field(i).name for i in range(kind.num_fields))]
        return names


def answer_fields(route: str) -> list[pa.Field]:
    """The columns a dataset job's route adds to each row."""
    endpoint = endpoint_named(route)
    own = _ROUTE_COLUMNS.get(route) or (_ROUTE_COLUMNS["text"] if endpoint.generates else [])
    return [*own, *_COMMON_COLUMNS]


def _error_of(record: dict[str, Any]) -> dict[str, str] | None:
    """The row's error: a line refused before any engine (`error`), or the engine's error response."""
    error = record.get("error")
    if isinstance(error, dict):
        return {"code": str(error.get("code")), "message": str(error.get("message"))}
    response = record.get("response") or {}
    body = response.get("body")
    if (response.get("status_code") or 200) >= 400 or (isinstance(body, dict) and "error" in body):
        failure = (body or {}).get("error") if isinstance(body, dict) else None
        failure = failure if isinstance(failure, dict) else {}
        code = failure.get("code") or failure.get("type") or f"http_{response.get('status_code')}"
        return {"code": str(code), "message": str(failure.get("message", ""))}
    return None


def answers(records: list[str], route: str) -> pa.Table:
    """The answer columns of each output line (a result or an error record)."""
    fields = answer_fields(route)
    columns: dict[str, list[Any]] = {field.name: [] for field in fields}
    for line in records:
        record = json_codec.loads(line)
        error = _error_of(record)
        body = (record.get("response") or {}).get("body")
        endpoint = endpoint_answering(body) if error is None else None
        flat = endpoint.flatten(body) if endpoint is not None else {}
        prompt, completion = endpoint.usage(body) if endpoint is not None else (0, 0)
        values = {
            "content": flat.get("content"),
            "finish_reason": flat.get("finish_reason"),
            "embedding": (flat.get("embeddings") or [None])[0],
            "score": (flat.get("scores") or [None])[0],
            "prompt_tokens": prompt if error is None else None,
            "completion_tokens": completion if error is None else None,
            "error": error,
        }
        if not isinstance(values["content"], str | None):
            values["content"] = json_codec.dumps(values["content"])
        for name in columns:
            columns[name].append(values[name])
    table = pa.table(columns, schema=pa.schema(fields))
    if "embedding" in columns:
        # One model's vectors have one size: a fixed-size list is what vector readers (numpy, Lance, FAISS) take.
        sizes = {len(vector) for vector in columns["embedding"] if vector is not None}
        if len(sizes) == 1:
            fixed = pa.list_(pa.float32(), sizes.pop())
            index = table.schema.get_field_index("embedding")
            table = table.set_column(index, pa.field("embedding", fixed), table.column(index).cast(fixed))
    return table


def plain(value: Any) -> Any:
    """A kept value as JSON has it: a date or time in ISO form, bytes as UTF-8 text (base64 when they are not),
    a decimal as its digits."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(value).decode("ascii")
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    return value


def _kept_columns(rows: pa.ChunkedArray | pa.Array) -> pa.Table:
    """The kept columns, as a table: a struct's fields as they were typed; JSON text typed by Arrow (the row's JSON
    text as it is, in a `row` column, when Arrow finds no one type for a column across the rows)."""
    rows = rows.combine_chunks() if isinstance(rows, pa.ChunkedArray) else rows
    if pa.types.is_struct(rows.type):
        return pa.Table.from_struct_array(rows)
    dicts = [json_codec.loads(text) if text is not None else {} for text in rows.to_pylist()]
    try:
        return pa.Table.from_pylist(dicts)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.table({"row": rows})


def _with_parsed(answer: pa.Table, table: TableOutput) -> pa.Table:
    """The answers with the parsed JSON: one `parsed` column, or its fields as columns."""
    parsed = parsed_column(answer.column("content").to_pylist(), table.json_schema)
    if table.json_output == "columns" and pa.types.is_struct(parsed.type):
        fields = pa.Table.from_struct_array(parsed)
        return pa.table(
            [*answer.columns, *fields.columns], names=[*answer.column_names, *fields.column_names]
        )
    return answer.append_column("parsed", parsed)


def answered_table(rows: pa.Table, records: list[str], table: TableOutput) -> pa.Table:
    """Kept columns then answer columns, row for row (`rows` and `records` in the same order). An answer column
    takes the place of a kept column of the same name."""
    kept = _kept_columns(rows.column("row"))
    answer = answers(records, table.route)
    if table.json_output is not None:
        answer = _with_parsed(answer, table)
    kept = kept.drop_columns([name for name in answer.column_names if name in kept.column_names])
    if not kept.num_columns:
        return answer
    return pa.table([*kept.columns, *answer.columns], names=[*kept.column_names, *answer.column_names])


class _ParquetTable:
    extension = "parquet"

    def __init__(self, sink: HashingSink) -> None:
        self._sink = sink
        self._writer: pq.ParquetWriter | None = None

    def write_table(self, table: pa.Table) -> None:
        if self._writer is None:
            self._writer = pq.ParquetWriter(self._sink, table.schema, compression="zstd")
        self._writer.write_table(table, row_group_size=WRITE_BATCH_ROWS)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._sink.close()


class _JsonlTable:
    extension = "jsonl"

    def __init__(self, sink: HashingSink) -> None:
        self._sink = sink

    def write_table(self, table: pa.Table) -> None:
        for batch in table.to_batches(WRITE_BATCH_ROWS):
            lines = "".join(json_codec.dumps(plain(row)) + "\n" for row in batch.to_pylist())
            self._sink.write(lines.encode("utf-8"))

    def close(self) -> None:
        self._sink.close()


def table_encoder(fmt: str) -> tuple[Callable[[HashingSink], Any], str]:
    encoders = {"parquet": _ParquetTable, "jsonl": _JsonlTable}
    if fmt not in encoders:
        raise ValueError(f"unknown output format {fmt!r}: use jsonl or parquet")
    return functools.partial(encoders[fmt]), fmt
