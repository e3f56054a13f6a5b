"""Shared fixtures: request-line builders and a private NIGHTSHIFT_HOME-free setup (the model cache is reused)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

MODEL_NAME = "smollm2-135m-instruct"


def chat_line(custom_id: str, content: str, **body) -> str:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def completion_line(custom_id: str, prompt: str, **body) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def read_jsonl(paths) -> list[dict]:
    rows = []
    for path in sorted(paths):
        rows.extend(json.loads(line) for line in Path(path).read_text().splitlines() if line)
    return rows


def staged_rows(staging, kind: str) -> list:
    """Every staged row of `kind` ("results" or "errors"), in the order finalize writes them."""
    import pyarrow as pa

    from pipeline.io.staging import StagedRow
    from pipeline.stages.finalize import sort_table

    parts = staging.parts(kind)
    if not parts:
        return []
    table = sort_table(pa.concat_tables(staging.read_part(part) for part in parts), kind)
    return [StagedRow(**row) for row in table.to_pylist()]


@pytest.fixture(scope="session")
def embedded_model():
    """The embedded model, converted into NIGHTSHIFT_HOME on first use (about 20 s) and reused after that."""
    from pipeline.models import resolve_model

    return resolve_model(None)


@pytest.fixture
def make_input(tmp_path):
    def make(lines: list[str], name: str = "input.jsonl") -> Path:
        return write_lines(tmp_path / name, lines)

    return make


def pytest_terminal_summary(terminalreporter):
    """Print what the failure tests measured (see tests/failure_figures.py)."""
    from tests.failure_figures import FIGURES, summary_lines

    if FIGURES:
        terminalreporter.write_sep("-", "failure figures (rows lost and duplicated must be 0)")
        for line in summary_lines():
            terminalreporter.write_line(line)
