"""A table's row made a request line: the id, the rendered templates in the route's body, the sampling fields.

    renderer = RowRenderer(config.dataset)
    renderer.check_columns(["id", "title", "text"])       # DatasetError before any work: a column the table lacks
    renderer.request(row, number=7, file_index=0)          # {"custom_id", "method", "url", "body"} or a BadRow

The request then goes the way every request line goes (validation, fitting, routing, the engines): a dataset job
differs from a request-line job only in how its rows are read and how its output is written.

Row ids (`custom_id`) are the order the output is sorted in (finalize sorts ids by their UTF-8 bytes):
- with an id column, a string id is itself and an integer id is written so that byte order is numeric order;
- without one, the row's place in the input, `f{file:05d}r{row:012d}`: input order, and the same on every read of
  an unchanged input, which is what resume's exactly-once needs.

Pure: no Ray, no vLLM.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from functools import cached_property
from typing import Any, NamedTuple

from pipeline import json_codec
from pipeline.datasets.media import MediaCellError, media_urls
from pipeline.datasets.output import TableOutput
from pipeline.datasets.spec import DatasetConfig
from pipeline.datasets.template import PromptTemplate, RenderError
from pipeline.endpoints import endpoint_named
from pipeline.io.rows import BadRow, TableRead, TableRow

_INT_OFFSET = 1 << 63  # int64 ids shifted to unsigned: their fixed-width hex sorts as the numbers do


class DatasetError(ValueError):
    """A dataset job that cannot run on this table (a column its templates name is missing): before any work."""


def position_id(file_index: int, row: int) -> str:
    return f"f{file_index:05d}r{row:012d}"


def sortable_id(value: Any) -> str | None:
    """The custom_id of an id column's value; None for a value that cannot be an id (null, float, ...)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if not -_INT_OFFSET <= value < _INT_OFFSET:
            return None
        return f"#{value + _INT_OFFSET:016x}"
    if isinstance(value, str) and value:
        return value
    return None


class Rendered(NamedTuple):
    request: dict[str, Any] | BadRow
    row: dict[str, Any] | None


class RowRenderer:
    def __init__(self, spec: DatasetConfig, max_json_depth: int = json_codec.DEFAULT_MAX_DEPTH) -> None:
        if not spec.enabled:
            raise ValueError("not a dataset job: dataset.template is not set")
        self.spec = spec
        self.endpoint = endpoint_named(spec.route)
        self.url = self.endpoint.urls[0]
        self.max_json_depth = max_json_depth
        named = {"dataset.template": spec.template, "dataset.system": spec.system}
        named["dataset.pair_template"] = spec.pair_template
        self.templates = {
            name: PromptTemplate(text, name) for name, text in named.items() if text is not None
        }
        self.sampling = spec.sampling()
        # Rows that failed to render, by the column that made them fail ("" when none is to blame): `validate`'s
        # template errors per column.
        self.failures_by_column: Counter[str] = Counter()

    @property
    def columns(self) -> set[str]:
        """Every column a request is made from."""
        used = set().union(*(t.columns for t in self.templates.values()))
        return self.spec.columns_read(used)

    def check_columns(self, present: Iterable[str]) -> None:
        present = list(present)
        missing = sorted(self.columns - set(present))
        if missing:
            users = [name for name, t in self.templates.items() if t.columns & set(missing)] or [
                "dataset.id_column / dataset.body_columns"
            ]
            raise DatasetError(
                f"{', '.join(users)} name{'s' if len(users) == 1 else ''} column(s) the table does not have: "
                f"{', '.join(missing)} (it has: {', '.join(present) or 'no columns'})"
            )
        kept = sorted(set(self.spec.keep_columns or ()) - set(present))
        if kept:
            raise DatasetError(
                f"dataset.keep_columns names column(s) the table does not have: {', '.join(kept)} "
                f"(it has: {', '.join(present)})"
            )
        answers = self.output.answer_names()
        clash = [name for name in answers if name in (self.spec.keep_columns or present)]
        if clash:
            raise DatasetError(
                f"the table's column(s) {', '.join(clash)} have the names of answer columns the output adds: keep "
                "the others only (dataset.keep_columns / --keep-columns), or rename them"
            )

    @cached_property
    def output(self) -> TableOutput:
        """How finalize writes this job's table: the answer columns of its route, a JSON answer's parsing."""
        return TableOutput.of(self.spec)

    def check_table(self, source: Any) -> None:
        """Check the columns of `source` (an io.readers.InputSource reading this job's table: `table_read()`), from its
        first file, against the templates: DatasetError before any work. An input without a row has nothing to
        check."""
        if source.table != self.table_read():
            raise ValueError(
                "the input is not read as this job's table: give check_input_source its table_read()"
            )
        columns = source.table_columns()
        if columns is not None:
            self.check_columns(columns)

    def table_read(self) -> TableRead:
        """How the input is read: the columns requests are made of and the kept ones (all, when not named); only
        the first as Python values (a Parquet input's kept columns stay in Arrow)."""
        rendered = tuple(sorted(self.columns))
        if self.spec.keep_columns is None:
            return TableRead(None, rendered)
        return TableRead(tuple(sorted(self.columns | set(self.spec.keep_columns))), rendered)

    def row_id(self, row: dict[str, Any], number: int, file_index: int) -> str | None:
        if self.spec.id_column is None:
            return position_id(file_index, number)
        return sortable_id(row.get(self.spec.id_column))

    def read(self, payload: bytes | dict[str, Any] | BadRow, number: int, file_index: int) -> Rendered:
        """A row as the reader gave it (a JSONL line's bytes, a Parquet row's dict, or a BadRow) made a request:
        the request line or the row's BadRow, and the row's values (None when the line is no object)."""
        if isinstance(
            payload, BadRow
        ):  # a line over the length limit: still a row of the output, at its place
            return Rendered(payload._replace(custom_id=position_id(file_index, number)), None)
        if isinstance(payload, bytes | str):
            try:
                row = json_codec.loads(payload, self.max_json_depth)
            except (ValueError, UnicodeDecodeError) as exc:
                bad = BadRow(
                    position_id(file_index, number), f"the line is not valid JSON: {exc}", "invalid_json"
                )
                return Rendered(bad, None)
        else:
            row = payload
        request = self.request(row, number, file_index)
        return Rendered(request, row if isinstance(row, dict) else None)

    def kept(self, row: dict[str, Any] | None) -> dict[str, Any] | None:
        """The columns of `row` the output keeps (a Parquet TableRow as it is: its batch holds them, and KeptRows
        takes them from there)."""
        if row is None or self.spec.keep_columns is None or isinstance(row, TableRow):
            return row
        return {column: row.get(column) for column in self.spec.keep_columns}

    def request(self, row: Any, number: int, file_index: int) -> dict[str, Any] | BadRow:
        """The request line of one row, or the BadRow of a row that makes none (its error record)."""
        if not isinstance(row, dict):
            return BadRow(
                position_id(file_index, number),
                f"a table row must be a JSON object, not {type(row).__name__}",
                "invalid_json",
            )
        custom_id = self.row_id(row, number, file_index)
        if custom_id is None:
            # Still a row of the output: it keeps its place in the input as its id, with its error.
            value = row.get(self.spec.id_column or "")
            return BadRow(
                position_id(file_index, number),
                f"id column {self.spec.id_column!r} is {value!r} in this row: an id is a non-empty string or an "
                "integer",
                "invalid_custom_id",
            )
        try:
            texts = {name: template.render(row) for name, template in self.templates.items()}
        except RenderError as exc:
            self.failures_by_column.update(exc.columns or ("",))
            return BadRow(custom_id, str(exc), "template_error")
        body = self.endpoint.templated_body(
            texts.get("dataset.template"), texts.get("dataset.system"), texts.get("dataset.pair_template")
        )
        for kind, column in self.spec.media_columns.items():
            try:
                urls = media_urls(row.get(column), column, self.spec.media_root)
            except MediaCellError as exc:
                self.failures_by_column[column] += 1
                return BadRow(custom_id, str(exc), "template_error")
            with_media = self.endpoint.with_media(body, kind, urls)
            if isinstance(with_media, str):
                self.failures_by_column[column] += 1
                return BadRow(custom_id, with_media, "template_error")
            body = with_media
        for field, column in self.spec.body_columns.items():
            value = row.get(column)
            if value is not None:  # null: the job's own value (or the route's default) applies to this row
                body[field] = value
        body = {**self.sampling, **body}
        return {"custom_id": custom_id, "method": "POST", "url": self.url, "body": body}
