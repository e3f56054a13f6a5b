"""Storage retries fast enough for tests, and bare requests and rows to stage (the fields the work list and the
accounting read, not a whole response)."""

from __future__ import annotations

import json

from pipeline.io.staging import StagedRow

FAST_RETRIES = {"retries": 3, "retry_backoff_s": 0.01, "retry_backoff_max_s": 0.05, "timeout_s": 10}


def result_row(custom_id: str) -> StagedRow:
    record = {"id": f"batch_req_{custom_id}", "custom_id": custom_id, "response": {"status_code": 200}}
    return StagedRow(custom_id, 1, "in.jsonl", None, 3, 5, "default", json.dumps(record))


def error_row(line: int, custom_id: str | None = None, code: str = "invalid_json") -> StagedRow:
    record = {"id": f"batch_req_{line}", "custom_id": custom_id, "error": {"code": code, "line": line}}
    return StagedRow(custom_id, line, "in.jsonl", code, 0, 0, "", json.dumps(record))


def request(custom_id: str, line: int) -> dict:
    return {"custom_id": custom_id, "url": "/v1/chat/completions", "body": "{}", "line": line, "source": "in"}
