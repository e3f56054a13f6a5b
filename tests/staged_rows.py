"""Staged rows: whole result rows and error rows as engines and ingest stage them, staged in parts of random
sizes, custom_ids from a wide alphabet; and what a staging area holds, read back in the order finalize writes it."""

from __future__ import annotations

import json
import random

from pipeline.io.staging import StagedRow, StagingArea


def result_row(custom_id: str, line: int = 1, source: str = "in.jsonl") -> StagedRow:
    body = {
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": f"answer {custom_id}"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    }
    record = {
        "id": f"batch_req_{custom_id}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": "r", "body": body},
        "error": None,
    }
    return StagedRow(custom_id, line, source, None, 3, 5, "default", json.dumps(record, ensure_ascii=False))


def error_row(line: int, source: str = "in.jsonl", custom_id: str | None = None) -> StagedRow:
    record = {
        "id": f"batch_req_{source}_{line}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": "invalid_json", "message": "bad", "line": line, "source": source},
    }
    return StagedRow(custom_id, line, source, "invalid_json", 0, 0, "", json.dumps(record))


def stage_randomly(staging: StagingArea, kind: str, rows: list[StagedRow], seed: int = 1) -> None:
    rng = random.Random(seed)
    rows = rows[:]
    rng.shuffle(rows)
    while rows:
        size = rng.randint(1, 40)
        staging.write_rows(kind, rows[:size])
        rows = rows[size:]


def unicode_ids(n: int, seed: int = 2) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcXYZ019-_éß日😀\uffff"
    ids: set[str] = set()
    while len(ids) < n:
        ids.add("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 10))))
    return list(ids)


def staged_rows(staging, kind: str) -> list:
    """Every staged row of `kind` ("results" or "errors"), in the order finalize writes them."""
    import pyarrow as pa

    from pipeline.stages.shard import sort_table

    parts = staging.parts(kind)
    if not parts:
        return []
    table = sort_table(pa.concat_tables(staging.read_part(part) for part in parts), kind)
    return [StagedRow(**row) for row in table.to_pylist()]
