"""A batch input's lines, checked by the server before any job reads them.

At upload (`check_upload`): a batch input is JSONL, one request object per line. A file in which no line is a JSON
object (a binary, a CSV, a JSON array, prose) is not JSONL at all and is refused, naming its first line. A file
with some such lines is kept — nightshift makes each bad line an error record and runs the rest — and its `status`
says so: `error`, with `status_details` naming the lines; a clean file is `processed`.

Before a batch runs, with `limits.line_errors: fail_batch` (`invalid_lines`): every line through the job's own
validator (the envelope, custom_id and its duplicates, the batch's endpoint, the model names the job serves), as
OpenAI validates a batch before running it: any invalid line fails the batch, its errors listing the lines.

Both read the file in one stream, a line at a time; neither starts Ray or an engine."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import ConfigError, InputLimits, JobConfig
from pipeline.io.jsonl import iter_jsonl
from pipeline.io.rows import BadRow
from pipeline.json_codec import loads
from pipeline.server.schemas import BatchError

EXAMPLES = 5  # bad lines named in a file's status_details
MAX_LISTED_ERRORS = 100  # invalid lines listed in a failed batch's errors; the count says how many more


@dataclass
class UploadCheck:
    lines: int = 0  # non-blank lines: what a batch counts as its requests
    objects: int = 0  # lines that are JSON objects
    bad: list[tuple[int, str]] = field(default_factory=list)  # the first EXAMPLES others: (line, why)

    @property
    def invalid(self) -> int:
        return self.lines - self.objects

    def refusal(self) -> str | None:
        """Why the file is not JSONL at all, or None when it is."""
        if self.objects:
            return None
        if not self.bad:
            return (
                "the file holds no request: every line is blank; a batch input is JSONL, one request per line"
            )
        line, why = self.bad[0]
        return (
            f"the file is not JSONL: line {line} is not a JSON object ({why}), nor is any other line; a batch "
            "input holds one request object per line"
        )

    def status(self) -> tuple[str, str | None]:
        """The file's (status, status_details)."""
        if not self.invalid:
            return "processed", None
        named = ", ".join(f"line {line}: {why}" for line, why in self.bad)
        more = f" (and {self.invalid - len(self.bad)} more)" if self.invalid > len(self.bad) else ""
        return "error", (
            f"{self.invalid} of {self.lines} lines are not JSON objects — {named}{more}. A batch reading this file "
            "makes each an error record (limits.line_errors: fail_batch fails the batch instead)."
        )


_JSON_KINDS = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def _why(raw: bytes, max_depth: int) -> str | None:
    """Why one non-blank line is not a JSON object, or None when it is one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at column {exc.start + 1}"
    try:
        value = loads(text, max_depth)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc.msg} at column {exc.colno}"
    except ValueError as exc:  # nested deeper than limits.max_json_depth
        return str(exc)
    if not isinstance(value, dict):
        return f"a JSON {_JSON_KINDS.get(type(value), 'value')}, not an object"
    return None


def check_upload(path: Path, limits: InputLimits) -> UploadCheck:
    """Each non-blank line of an uploaded file: a JSON object or not (the job's reader's line rules: blank lines
    skipped, a leading BOM dropped, a line past limits.max_line_bytes never held whole)."""
    check = UploadCheck()
    with open(path, "rb") as stream:
        for _, number, payload in iter_jsonl(stream, path.name, limits.max_line_bytes):
            check.lines += 1
            why = payload.message if isinstance(payload, BadRow) else _why(payload, limits.max_json_depth)
            if why is None:
                check.objects += 1
            elif len(check.bad) < EXAMPLES:
                check.bad.append((number, why))
    return check


def served_before_run(job: JobConfig) -> dict[str, str | None]:
    """Every model name a line of a batch may give (the pools' served names and their LoRA adapters), known from
    the job config alone, as `nightshift validate` knows it: name -> task (None: the task is the engine's to
    check). A job whose servers name their model (the http backend without --model) cannot say before it runs."""
    from pipeline.job_plan import JobPlan, JobPlanError

    try:
        served = JobPlan.of(job).served
    except JobPlanError as exc:
        raise ConfigError(str(exc)) from exc
    if served is None:
        raise ConfigError(
            "limits.line_errors fail_batch checks each line's model before a batch runs: with the http backend "
            "give job.model (or job.served_model_name), the name the servers serve"
        )
    return served.validation_map()


def invalid_lines(
    path: Path, served: Mapping[str, str | None], limits: InputLimits
) -> tuple[list[BatchError], int, int]:
    """(errors of the first MAX_LISTED_ERRORS invalid lines, invalid lines, lines) of a batch input, each error in
    OpenAI's shape: the line's error code and message, and its 1-based line number."""
    from pipeline.stages.intake import InputCounts, iter_validated
    from pipeline.stages.validate import InvalidLine, LineValidator

    report = InputCounts(source=str(path))
    listed: list[BatchError] = []
    invalid = 0
    for outcome in iter_validated(path, LineValidator(dict(served), None, limits), report):
        if not isinstance(outcome, InvalidLine):
            continue
        invalid += 1
        if len(listed) < MAX_LISTED_ERRORS:
            error = outcome.record["error"]
            listed.append(BatchError(code=error["code"], message=error["message"], line=outcome.line))
    return listed, invalid, report.lines
