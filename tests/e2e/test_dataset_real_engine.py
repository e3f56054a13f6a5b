"""A dataset job on the real engine: a table of 200 rows (nulls, missing values, unicode, one row too long for the
context) through `--template` gives every row the text the same requests get when written by hand as Batch lines
through `nightshift run`, keeps every input column, one row per input row, and puts the rows that could not run in
the `error` column."""

from __future__ import annotations

import json

import pytest

from tests.e2e.cli import run_cli
from tests.lines import read_jsonl, write_lines

pytestmark = pytest.mark.slow

ROWS = 200
SYSTEM = "You are terse."
TEMPLATE = "Title: {{ title }}\n{{ text }}"
MAX_TOKENS = 6


def _rows() -> list[dict]:
    rows = []
    for i in range(ROWS):
        row = {
            "id": i,
            "title": f"Nº {i} — café ✓",
            "text": f"Say something about the number {i}.",
            "tag": i % 3,
        }
        if i % 50 == 7:
            row["text"] = None  # null: the template would print "None"
        if i % 50 == 9:
            del row["text"]  # missing
        if i == 123:
            row["text"] = "word " * 900  # past the 512-token context of the warm engines
        rows.append(row)
    return rows


def _by_hand(row: dict) -> str:
    """The Batch line a user would write for one row."""
    body = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Title: {row['title']}\n{row['text']}"},
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    return json.dumps(
        {"custom_id": f"row-{row['id']:03d}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


@pytest.fixture(scope="module")
def both_runs(e2e_dir, shared_engines):
    rows = _rows()
    table = write_lines(e2e_dir / "table.jsonl", [json.dumps(row, ensure_ascii=False) for row in rows])
    lines = write_lines(
        e2e_dir / "by-hand.jsonl", [_by_hand(row) for row in rows if row.get("text") is not None]
    )
    outputs = {}
    for name, path, extra in (
        (
            "table",
            table,
            [
                "--template",
                TEMPLATE,
                "--system",
                SYSTEM,
                "--id-column",
                "id",
                "--max-tokens",
                str(MAX_TOKENS),
                "--temperature",
                "0",
            ],
        ),
        ("lines", lines, []),
    ):
        output = e2e_dir / f"dataset-{name}"
        proc = run_cli(
            "run", str(path), str(output), *shared_engines.one_pool_job(e2e_dir), *extra, "--no-progress"
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[name] = output
    return rows, outputs


def test_every_row_comes_back_once_with_its_columns_in_id_order(both_runs):
    rows, outputs = both_runs
    table = read_jsonl(sorted(outputs["table"].glob("results-*.jsonl")))
    assert [row["id"] for row in table] == list(range(ROWS))
    for given, got in zip(rows, table, strict=True):
        assert {key: got[key] for key in given} == given  # every input column, as it was
    assert not list(outputs["table"].glob("errors-*"))


def test_every_row_gets_the_text_the_same_request_gets_as_a_batch_line(both_runs):
    _, outputs = both_runs
    table = read_jsonl(sorted(outputs["table"].glob("results-*.jsonl")))
    by_hand = {
        r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"]
        for r in read_jsonl(outputs["lines"].glob("results-*.jsonl"))
    }
    refused = {r["custom_id"]: r for r in read_jsonl(outputs["lines"].glob("errors-*.jsonl"))}
    answered = [row for row in table if row["error"] is None]
    assert len(answered) == len(by_hand) == ROWS - 9  # 4 null, 4 missing, 1 too long
    for row in answered:
        assert row["content"] == by_hand[f"row-{row['id']:03d}"], row["id"]
        assert row["finish_reason"] in ("length", "stop") and 0 < row["completion_tokens"] <= MAX_TOKENS
    errors = {row["id"]: row["error"]["code"] for row in table if row["error"] is not None}
    assert errors == {
        **{i: "template_error" for i in range(ROWS) if i % 50 in (7, 9)},
        123: "context_length_exceeded",
    }
    assert list(refused) == ["row-123"]
