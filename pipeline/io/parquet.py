"""Parquet input: a file of `custom_id`, `url`, `body` (a JSON string or a struct) and optionally `method`, read one
row group batch at a time, its values turned back into JSON-shaped Python."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pipeline import json_codec
from pipeline.io.rows import DEFAULT_MAX_LINE_BYTES, BadRow, InputFormatError, Row, TableRow, too_long

PARQUET_SUFFIXES = (".parquet", ".pq", ".parq")
PARQUET_MAGIC = b"PAR1"
REQUIRED_PARQUET_COLUMNS = ("custom_id", "url", "body")


def _cleaner(arrow_type) -> Callable[[Any], Any] | None:
    """How to turn one Parquet value of `arrow_type` back into JSON-shaped Python: structs → dicts without the
    null fields a struct column invents for rows that lack them, maps → dicts. None when nothing needs doing."""
    import pyarrow as pa

    if pa.types.is_struct(arrow_type):
        fields = [
            (arrow_type.field(i).name, _cleaner(arrow_type.field(i).type))
            for i in range(arrow_type.num_fields)
        ]

        def clean_struct(value: Any) -> Any:
            if value is None:
                return None
            out = {}
            for name, sub in fields:
                item = value.get(name)
                if item is None:
                    continue
                out[name] = sub(item) if sub else item
            return out

        return clean_struct
    if pa.types.is_map(arrow_type):
        key_clean, item_clean = _cleaner(arrow_type.key_type), _cleaner(arrow_type.item_type)

        def clean_map(value: Any) -> Any:
            if value is None:
                return None
            return {
                (key_clean(k) if key_clean else k): (item_clean(v) if item_clean else v) for k, v in value
            }

        return clean_map
    if (
        pa.types.is_list(arrow_type)
        or pa.types.is_large_list(arrow_type)
        or pa.types.is_fixed_size_list(arrow_type)
    ):
        inner = _cleaner(arrow_type.value_type)
        if inner is None:
            return None
        return lambda value: None if value is None else [inner(v) for v in value]
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return lambda value: None if value is None else value.decode("utf-8", "replace")
    if pa.types.is_timestamp(arrow_type) or pa.types.is_date(arrow_type) or pa.types.is_decimal(arrow_type):
        return lambda value: None if value is None else str(value)
    return None


def parquet_schema_problem(schema, name: str) -> str | None:
    missing = [c for c in REQUIRED_PARQUET_COLUMNS if c not in schema.names]
    if missing:
        return (
            f"parquet input {name} has no column {', '.join(missing)} (it has: {', '.join(schema.names)}); "
            "expected custom_id, url, body (a JSON string or a struct) and optionally method"
        )
    return None


def open_parquet(handle: Any, name: str):
    """A pyarrow ParquetFile of `handle` (a path or a seekable file object); InputFormatError when it is not one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(handle)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputFormatError(f"{name} is not a readable Parquet file: {exc}") from exc


def check_parquet_schema(handle: Any, name: str) -> None:
    """Read only the footer of `handle` (a path or a seekable file object): InputFormatError when it is not a
    Parquet file of request rows."""
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(handle)
    except Exception as exc:  # noqa: BLE001
        raise InputFormatError(f"{name} is not a readable Parquet file: {exc}") from exc
    problem = parquet_schema_problem(schema, name)
    if problem:
        raise InputFormatError(problem)


def iter_parquet(
    handle: Any,
    source: str,
    batch_rows: int = 8192,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_json_depth: int = json_codec.DEFAULT_MAX_DEPTH,
    row_groups: Sequence[int] | None = None,
    first_number: int = 1,
    rows: tuple[int, int | None] = (0, None),
) -> Iterator[Row]:
    """Rows of a Parquet file (a path or a seekable file object), one row group batch at a time. A `body` string
    is held to the same limits as a JSONL line: `max_line_bytes`, and json_codec's nesting bound. `row_groups`:
    only those (consecutive) groups, of their rows `rows` = (skipped, taken or None for the rest), the first read
    numbered `first_number`."""
    import pyarrow as pa

    pf = open_parquet(handle, source)
    schema = pf.schema_arrow
    problem = parquet_schema_problem(schema, source)
    if problem:
        raise InputFormatError(problem)
    columns = [c for c in ("custom_id", "method", "url", "body") if c in schema.names]
    body_type = schema.field("body").type
    body_is_text = pa.types.is_string(body_type) or pa.types.is_large_string(body_type)
    body_is_binary = pa.types.is_binary(body_type) or pa.types.is_large_binary(body_type)
    clean_body = None if (body_is_text or body_is_binary) else _cleaner(body_type)
    clean = {c: _cleaner(schema.field(c).type) for c in columns if c != "body"}
    number = first_number - 1
    for batch in _batches(pf, batch_rows, row_groups, columns, rows):
        data = {}
        for name in columns:
            values = batch.column(name).to_pylist()
            fix = clean.get(name)
            data[name] = [fix(v) for v in values] if fix else values
        for i in range(batch.num_rows):
            number += 1
            row = {name: data[name][i] for name in columns}
            body = row.get("body")
            if body is not None:
                if body_is_text or body_is_binary:
                    if len(body) > max_line_bytes:
                        yield Row(
                            source, number, too_long("body", len(body), max_line_bytes, row.get("custom_id"))
                        )
                        continue
                    try:
                        row["body"] = json_codec.loads(body, max_json_depth)
                    except (ValueError, UnicodeDecodeError) as exc:
                        yield Row(
                            source, number, BadRow(row.get("custom_id"), f"body is not valid JSON: {exc}")
                        )
                        continue
                elif clean_body is not None:
                    row["body"] = clean_body(body)
            if row.get("method") is None:
                row.pop("method", None)
            yield Row(source, number, row)


def iter_table_parquet(
    handle: Any,
    source: str,
    columns: Sequence[str] | None = None,
    batch_rows: int = 8192,
    row_groups: Sequence[int] | None = None,
    first_number: int = 1,
    rendered: Sequence[str] | None = None,
    rows: tuple[int, int | None] = (0, None),
) -> Iterator[Row]:
    """Rows of a Parquet table (a dataset job's input), read as `columns` (all when None): each a TableRow of the
    `rendered` columns (all read, when None) as Arrow gives them to Python — a timestamp a datetime, binary bytes, a
    struct a dict — that knows its place in its Arrow batch, which holds the rest."""
    pf = open_parquet(handle, source)
    names = pf.schema_arrow.names
    wanted = [c for c in names if columns is None or c in columns]
    python = [c for c in wanted if rendered is None or c in rendered]
    number = first_number - 1
    for batch in _batches(pf, batch_rows, row_groups, wanted, rows):
        values = [batch.column(name).to_pylist() for name in python]
        for index, row_values in enumerate(zip(*values, strict=True) if values else [()] * batch.num_rows):
            number += 1
            row = TableRow(zip(python, row_values, strict=True))
            row.batch, row.index = batch, index
            yield Row(source, number, row)


def _batches(
    pf: Any,
    batch_rows: int,
    row_groups: Sequence[int] | None,
    columns: list[str],
    rows: tuple[int, int | None],
):
    """The record batches of `row_groups`, of their rows only `rows` = (skipped, taken or None): skipped rows are
    sliced off in Arrow, never made Python values."""
    skip, take = rows
    for batch in pf.iter_batches(batch_size=batch_rows, row_groups=row_groups, columns=columns):
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        if skip:
            batch, skip = batch.slice(skip), 0
        if take is not None:
            if take <= 0:
                return
            batch = batch.slice(0, take)
            take -= batch.num_rows
        yield batch
        if take is not None and take <= 0:
            return
