"""The rest of nightshift on a dataset job (a table and a template), on a real local Ray with the fake engine or
the http engine against a local OpenAI-compatible stub:

- LoRA: a column names each row's adapter (`body_columns: {model: adapter}`; a null row runs on the base model),
  and the manifest counts each adapter's rows;
- prefix routing: a long system prompt per `kind` is the shared prefix, so the rows of one kind run on one engine;
- the http engine: every row is one request to the server, answered once, its answer in the row;
- `status` and the report read a finished dataset job as they read any other.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import JobConfig
from pipeline.runtime.job import run_job
from tests.openai_stub import OpenAIStub

pytestmark = pytest.mark.usefixtures("local_ray")

ROWS = 240
MODEL = "smollm2-135m-instruct"


def _write(tmp_path: Path, table: pa.Table) -> Path:
    path = tmp_path / "table.parquet"
    pq.write_table(table, path, row_group_size=60)
    return path


def _answers(output: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(output.glob("results-*-of-*.parquet"))])


def test_a_column_names_each_rows_adapter_and_the_manifest_counts_them(tmp_path):
    adapters = [None, "support-lora", "sql-lora"]
    table = pa.table(
        {
            "id": list(range(ROWS)),
            "question": [f"question {i}" for i in range(ROWS)],
            "adapter": [adapters[i % 3] for i in range(ROWS)],
        }
    )
    output = tmp_path / "out"
    config = JobConfig.model_validate(
        {
            "input": str(_write(tmp_path, table)),
            "output": str(output),
            "engine": {
                "backend": "fake",
                "fake": {
                    "output_tokens": 3,
                    "lora_modules": {"support-lora": "/adapters/support", "sql-lora": "/adapters/sql"},
                },
            },
            "resources": {"num_engines": 1, "cpus_per_engine": 0.5},
            "dataset": {
                "template": "{{ question }}",
                "id_column": "id",
                "body_columns": {"model": "adapter"},
            },
        }
    )
    outcome = run_job(config, show_progress=False)
    answered = _answers(output)
    assert answered.column("id").to_pylist() == list(range(ROWS))
    assert answered.column("error").null_count == ROWS
    served = outcome.manifest["models"][MODEL]
    assert served["rows"] == ROWS
    assert {name: a["rows"] for name, a in served["adapters"].items()} == {
        "support-lora": ROWS // 3,
        "sql-lora": ROWS // 3,
    }


def test_a_system_prompt_per_kind_is_the_prefix_its_rows_are_routed_by(tmp_path):
    kinds = ["museum", "kitchen", "harbour"]
    table = pa.table(
        {
            "id": list(range(ROWS)),
            "kind": [kinds[i % 3] for i in range(ROWS)],
            "question": [f"question {i}" for i in range(ROWS)],
        }
    )
    output = tmp_path / "out"
    calls = tmp_path / "calls"
    config = JobConfig.model_validate(
        {
            "input": str(_write(tmp_path, table)),
            "output": str(output),
            "engine": {"backend": "fake", "fake": {"output_tokens": 2, "call_log": str(calls)}},
            "resources": {"num_engines": 2, "cpus_per_engine": 0.5, "rows_per_task": 8},
            "dataset": {
                "template": "{{ question }}",
                # A system prompt long enough to be a shared prefix worth routing by.
                "system": "You guide visitors of the {{ kind }}. " + "Answer with care and in detail. " * 40,
                "id_column": "id",
            },
        }
    )
    outcome = run_job(config, show_progress=False)
    assert _answers(output).column("id").to_pylist() == list(range(ROWS))
    routing = outcome.manifest["routing"]
    assert routing["used"] and routing["keys"] == len(kinds)
    assert routing["keyed_rows_in_input"] == ROWS
    assert sum(routing["rows_by_engine"].values()) == ROWS


def test_the_http_engine_answers_every_row_once(tmp_path):
    table = pa.table({"id": list(range(ROWS)), "text": [f"say {i}" for i in range(ROWS)]})
    output = tmp_path / "out"
    with OpenAIStub() as stub:
        config = JobConfig.model_validate(
            {
                "input": str(_write(tmp_path, table)),
                "output": str(output),
                "engine": {"backend": "http", "http": {"endpoints": [stub.url], "concurrency": 8}},
                "resources": {"num_engines": 1},
                "dataset": {"template": "{{ text }}", "id_column": "id", "max_tokens": 5},
            }
        )
        outcome = run_job(config, show_progress=False)
    answered = _answers(output)
    assert answered.column("id").to_pylist() == list(range(ROWS))
    assert answered.column("error").null_count == ROWS and all(answered.column("content").to_pylist())
    assert (
        set(stub.state.answered.values()) == {1} and len(stub.state.answered) == ROWS
    )  # one request per row
    assert outcome.manifest["counts"]["succeeded"] == ROWS

    status = subprocess.run(
        [sys.executable, "-m", "pipeline", "status", str(output), "--json"], capture_output=True, text=True
    )
    assert status.returncode == 0, status.stderr[-2000:]
    said = json.loads(status.stdout)
    assert said["state"] == "finished" and said["rows"] == {"total": ROWS, "done": ROWS, "failed": 0}, said
    assert f"{ROWS} total, {ROWS} ok, 0 failed" in (output / "report.html").read_text()
