"""What `nightshift run` with the fake engine writes for an input, computed in this process without Ray: the
expectation jobs run through the server or cut short by a window are compared with."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from pipeline.config import FakeEngineArgs
from pipeline.engines.base import EngineRequest, EngineSpec, build_engine
from pipeline.protocol import result_record
from pipeline.stages.validate import LineValidator, ValidRequest
from tests.lines import MODEL_NAME


def comparable(row: dict) -> tuple:
    """A row without its random ids: custom_id, status and body (fake bodies are deterministic)."""
    response = row["response"]
    if response is None:
        return (row["custom_id"], None, row["error"]["code"], row["error"]["line"])
    body = {k: v for k, v in response["body"].items() if k != "id"}
    return (row["custom_id"], response["status_code"], json.dumps(body, sort_keys=True))


def run_in_process(source: Path, fake: dict) -> tuple[list[dict], list[dict]]:
    """What `nightshift run` with the server's job config writes for `source`, computed without Ray: every line
    through the job's validator (duplicates included), every valid request through the fake engine (its answers
    are deterministic; the time model only delays them), results sorted by custom_id, errors by line."""
    validator = LineValidator(MODEL_NAME)
    args = {
        **FakeEngineArgs.model_validate(fake).model_dump(),
        "decode_seconds_per_token": 0.0,
    }
    engine = build_engine(EngineSpec("fake", "", MODEL_NAME, args))
    results, errors = [], []
    for number, raw in enumerate(source.read_bytes().splitlines(), start=1):
        outcome = validator(raw, number, source.name)
        if isinstance(outcome, ValidRequest):
            request = EngineRequest(outcome.custom_id, outcome.url, outcome.body)
            (answer,) = asyncio.run(engine.generate_all([request]))
            (results if answer.ok else errors).append(
                result_record(answer.custom_id, answer.body, answer.status_code)
            )
        else:
            errors.append(outcome.record)
    results.sort(key=lambda r: r["custom_id"].encode())
    return results, errors
