"""Read → validate → stage: turn the input into the engines' work list and the first error records.

Streams the input once (any location and format `pipeline.io.readers` knows): valid requests go to
`_staging/requests/` in Parquet parts (the engines' work list, read by Ray Data), invalid rows go straight to
`_staging/errors/`. The input fingerprint and row count are computed in the same pass. Memory: one part of requests
plus the custom_id set the duplicate check needs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import InputLimits, StorageConfig
from pipeline.io.readers import BadRow, InputSource, ReadStats, input_source
from pipeline.io.staging import INGEST_PREFIX, StagedRow, StagingArea
from pipeline.json_codec import dumps_body
from pipeline.protocol import ErrorCode, dumps, invalid_line_record
from pipeline.stages.route import prefix_key
from pipeline.stages.validate import InvalidLine, LineValidator, ValidRequest


@dataclass
class IngestReport:
    source: str
    fingerprint: str = ""
    size_bytes: int = 0
    lines: int = 0  # non-blank input lines / rows: the accounting base
    valid: int = 0
    keyed: int = 0  # valid requests with a prefix key (a shared leading prompt worth routing by)
    invalid_by_code: Counter = field(default_factory=Counter)
    files: int = 0

    @property
    def invalid(self) -> int:
        return sum(self.invalid_by_code.values())


def bad_row(validator: LineValidator, row: BadRow, line: int, source: str) -> InvalidLine:
    """An error the reader decided (a line over the length limit, a Parquet `body` string that is not JSON). A row
    with a custom_id still claims it, so a later row with the same id is a duplicate, as for any other invalid
    line."""
    custom_id = row.custom_id if isinstance(row.custom_id, str) and row.custom_id else None
    seen = validator._seen  # noqa: SLF001 - the duplicate rule is the validator's; this row takes part in it
    if custom_id is not None and custom_id in seen:
        code = ErrorCode.DUPLICATE_CUSTOM_ID
        message = f"custom_id {custom_id!r} already appeared earlier in the input"
    else:
        code, message = ErrorCode(row.code), row.message
        if custom_id is not None:
            seen.add(custom_id)
    seed = f"{validator.job_id}:{source}:{line}" if validator.job_id else None
    return InvalidLine(invalid_line_record(custom_id, code, message, line, source, seed), line, source)


def as_source(location: InputSource | Path | str, storage: StorageConfig | None = None) -> InputSource:
    return location if isinstance(location, InputSource) else input_source(str(location), storage)


def _validated(
    source: InputSource, validator: LineValidator, report: IngestReport
) -> Iterator[tuple[bytes | dict | BadRow, ValidRequest | InvalidLine]]:
    stats = ReadStats()
    source.limits = validator.limits  # the reader enforces the line-length bound, the validator the rest
    for name, number, payload in source.rows(stats):
        report.lines += 1
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
    location: InputSource | Path | str, validator: LineValidator, report: IngestReport
) -> Iterator[ValidRequest | InvalidLine]:
    """Validate every row of the input, fingerprinting it as it streams past."""
    for _, outcome in _validated(as_source(location), validator, report):
        yield outcome


def invalid_to_staged(item: InvalidLine) -> StagedRow:
    return StagedRow(
        custom_id=item.record["custom_id"],
        line=item.line,
        source=item.source,
        error_code=item.code,
        prompt_tokens=0,
        completion_tokens=0,
        pool="",
        record=dumps(item.record),
    )


def ingest(
    location: InputSource | Path | str,
    served: str | Mapping[str, str | None],
    staging: StagingArea,
    part_rows: int = 50_000,
    storage: StorageConfig | None = None,
    job_id: str | None = None,
    limits: InputLimits | None = None,
) -> IngestReport:
    """Validate the whole input into staging. Memory: one part of requests plus the custom_id set."""
    source = as_source(location, storage)
    report = IngestReport(source=str(location) if isinstance(location, Path | str) else source.describe())
    validator = LineValidator(served, job_id, limits)
    requests: list[dict] = []
    errors: list[StagedRow] = []
    for payload, outcome in _validated(source, validator, report):
        if isinstance(outcome, ValidRequest):
            key = prefix_key(outcome.url, outcome.body)
            report.keyed += key is not None
            requests.append(
                {
                    "custom_id": outcome.custom_id,
                    "url": outcome.url,
                    "body": dumps_body(outcome.body, payload),  # a valid outcome never comes from a BadRow
                    "line": outcome.line,
                    "source": outcome.source,
                    "prefix_key": key,
                    "model": outcome.body.get("model"),
                }
            )
            if len(requests) >= part_rows:
                staging.write_requests(requests)
                requests = []
        else:
            errors.append(invalid_to_staged(outcome))
            if len(errors) >= part_rows:
                staging.write_rows("errors", errors, prefix=INGEST_PREFIX)
                errors = []
    staging.write_requests(requests)
    staging.write_rows("errors", errors, prefix=INGEST_PREFIX)
    return report
