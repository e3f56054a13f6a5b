"""An input read and validated row by row, in one stream in this process (`nightshift validate`, `plan --input`),
and the counts every reading of an input makes. The job's ingest (runtime/ingest/tasks.py) reads the same rows in
parallel pieces and adds what only it does (keys, measurements, placement) to these counts.

Pure: no Ray, no vLLM.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import StorageConfig
from pipeline.datasets.render import RowRenderer
from pipeline.io.readers import InputSource, input_source
from pipeline.io.rows import BadRow, ReadStats
from pipeline.protocol import ErrorCode, invalid_line_record
from pipeline.stages.validate import InvalidLine, LineValidator, ValidRequest, duplicate_line


@dataclass
class InputCounts:
    source: str
    fingerprint: str = ""
    size_bytes: int = 0
    lines: int = 0  # non-blank input lines / rows: the accounting base
    valid: int = 0  # requests in the work list
    invalid_by_code: Counter = field(default_factory=Counter)
    files: int = 0

    @property
    def invalid(self) -> int:
        return sum(self.invalid_by_code.values())


def bad_row_check(row: BadRow, line: int, source: str, job_id: str | None) -> tuple[InvalidLine, str | None]:
    """The error record of a row the reader refused, and the custom_id it claims (None: none)."""
    custom_id = row.custom_id if isinstance(row.custom_id, str) and row.custom_id else None
    seed = f"{job_id}:{source}:{line}" if job_id else None
    record = invalid_line_record(custom_id, ErrorCode(row.code), row.message, line, source, seed)
    return InvalidLine(record, line, source), custom_id


def bad_row(validator: LineValidator, row: BadRow, line: int, source: str) -> InvalidLine:
    """An error the reader decided (a line over the length limit, a Parquet `body` string that is not JSON). A row
    with a custom_id still claims it, so a later row with the same id is a duplicate, as for any other invalid
    line."""
    outcome, claim = bad_row_check(row, line, source, validator.job_id)
    if claim is None:
        return outcome
    seen = validator._seen  # noqa: SLF001 - the duplicate rule is the validator's; this row takes part in it
    if claim in seen:
        return duplicate_line(claim, line, source, validator.job_id)
    seen.add(claim)
    return outcome


def as_source(location: InputSource | Path | str, storage: StorageConfig | None = None) -> InputSource:
    return location if isinstance(location, InputSource) else input_source(str(location), storage)


def _validated(
    source: InputSource, validator: LineValidator, report: InputCounts, renderer: RowRenderer | None = None
) -> Iterator[tuple[bytes | dict | BadRow, ValidRequest | InvalidLine]]:
    stats = ReadStats()
    source.limits = validator.limits  # the reader enforces the line-length bound, the validator the rest
    file_index = {file.name: index for index, file in enumerate(source.files)}
    for name, number, payload in source.rows(stats):
        report.lines += 1
        if renderer is not None:  # a dataset job's table: each row made its request first
            payload, _ = renderer.read(payload, number, file_index[name])
        if isinstance(payload, BadRow):
            outcome: ValidRequest | InvalidLine = bad_row(validator, payload, number, name)
        else:
            outcome = validator(payload, number, name)
        if isinstance(outcome, ValidRequest):
            report.valid += 1
        else:
            report.invalid_by_code[outcome.code] += 1
        yield payload, outcome
    report.fingerprint = stats.fingerprint
    report.size_bytes = stats.size_bytes
    report.files = stats.files


def iter_validated(
    location: InputSource | Path | str,
    validator: LineValidator,
    report: InputCounts,
    renderer: RowRenderer | None = None,
) -> Iterator[ValidRequest | InvalidLine]:
    """Validate every row of the input in this process, one stream (`nightshift validate`, `plan --input`); a
    dataset job's rows (`renderer`) are made requests first."""
    for _, outcome in _validated(as_source(location), validator, report, renderer):
        yield outcome
