"""Read → validate → stage: turn the input file into the engines' work list and the first error records.

Streams the input once: valid requests go to `_staging/requests/` in Parquet parts (the engines' work list, read
by Ray Data), invalid lines go straight to `_staging/errors/`. The input fingerprint and line count are computed
in the same pass.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.io.files import Fingerprint
from pipeline.io.staging import INGEST_PREFIX, StagedRow, StagingArea
from pipeline.protocol import dumps
from pipeline.stages.validate import InvalidLine, LineValidator, ValidRequest


@dataclass
class IngestReport:
    source: str
    fingerprint: str = ""
    size_bytes: int = 0
    lines: int = 0  # non-blank input lines: the accounting base
    valid: int = 0
    invalid_by_code: Counter = field(default_factory=Counter)

    @property
    def invalid(self) -> int:
        return sum(self.invalid_by_code.values())


def iter_validated(
    path: Path, validator: LineValidator, report: IngestReport
) -> Iterator[ValidRequest | InvalidLine]:
    """Validate every non-blank line of a local JSONL file, fingerprinting the bytes as they stream past."""
    fingerprint = Fingerprint()
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            fingerprint.update(raw)
            stripped = raw.strip()
            if not stripped:
                continue
            report.lines += 1
            outcome = validator(stripped, number, report.source)
            if isinstance(outcome, ValidRequest):
                report.valid += 1
            else:
                report.invalid_by_code[outcome.code] += 1
            yield outcome
    report.fingerprint = fingerprint.value
    report.size_bytes = fingerprint.size


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
    path: Path, model_name: str, staging: StagingArea, part_rows: int = 50_000, job_id: str | None = None
) -> IngestReport:
    """Validate the whole input into staging. Memory: one part of requests plus the custom_id set."""
    report = IngestReport(source=str(path))
    validator = LineValidator(model_name, job_id)
    requests: list[dict] = []
    errors: list[StagedRow] = []
    for outcome in iter_validated(path, validator, report):
        if isinstance(outcome, ValidRequest):
            requests.append(
                {
                    "custom_id": outcome.custom_id,
                    "url": outcome.url,
                    "body": json.dumps(outcome.body, ensure_ascii=False),
                    "line": outcome.line,
                    "source": outcome.source,
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
