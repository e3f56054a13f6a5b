"""Dataset jobs on a real local Ray cluster with the fake engine: a table in, the same table back with its answers —
every row once, sorted by its id, its columns kept as typed, its errors in the `error` column — through `nightshift
run` and through a kill and `resume`."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import JobConfig
from pipeline.runtime.job import run_job
from pipeline.runtime.preflight import PreflightError
from tests.lines import read_jsonl
from tests.runs import assert_same_shards, kill_driver_half_way, nightshift_ok, run_command, run_uninterrupted

pytestmark = pytest.mark.usefixtures("local_ray")

ROWS = 1200


def _table(rows: int) -> pa.Table:
    """Ids in shuffled order, unicode, a null and a missing value or two, a list column for few-shot examples."""
    ids = [(i * 7919) % rows for i in range(rows)]
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "title": [f"título {i} ✓" for i in ids],
            "text": [None if i % 97 == 13 else "body " * (i % 9) for i in ids],
            "shots": [[{"q": f"q{i}", "a": f"a{i}"}] for i in ids],
            "seen": [dt.datetime(2026, 1, 1) + dt.timedelta(minutes=i) for i in ids],
        }
    )


def _job(input_path: Path, output: Path, **dataset) -> JobConfig:
    return JobConfig.model_validate(
        {
            "input": str(input_path),
            "output": str(output),
            "model": None,
            "engine": {"backend": "fake", "fake": {"output_tokens": 4}},
            "resources": {"num_engines": 2, "cpus_per_engine": 0.5, "rows_per_task": 16},
            "output_options": {"rows_per_shard": 500, "staging_rows": 200},
            "dataset": {
                "template": "{% for s in shots %}{{ s.q }} => {{ s.a }}\n{% endfor %}{{ title }}: {{ text }}",
                "system": "Answer in one word.",
                "id_column": "id",
                "max_tokens": 4,
                **dataset,
            },
        }
    )


@pytest.fixture(scope="module")
def parquet_table(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("table") / "rows.parquet"
    pq.write_table(_table(ROWS), path, row_group_size=300)
    return path


def test_a_parquet_table_comes_back_with_every_row_its_columns_and_its_answer(parquet_table, tmp_path):
    output = tmp_path / "out"
    outcome = run_job(_job(parquet_table, output), show_progress=False)
    shards = sorted(output.glob("results-*-of-*.parquet"))
    assert len(shards) == 3 and not list(output.glob("errors-*"))
    table = pa.concat_tables([pq.read_table(shard) for shard in shards])
    assert table.column("id").to_pylist() == list(range(ROWS))  # every row once, sorted by its id
    source = _table(ROWS).sort_by("id")
    for name in source.column_names:  # kept as read, types included
        assert table.column(name).equals(source.column(name)), name
    nulls = [i for i in range(ROWS) if i % 97 == 13]
    errors = {row["id"]: row["error"] for row in table.to_pylist() if row["error"] is not None}
    assert sorted(errors) == nulls and {e["code"] for e in errors.values()} == {"template_error"}
    answered = [row for row in table.to_pylist() if row["error"] is None]
    assert all(row["content"] and row["finish_reason"] and row["completion_tokens"] == 4 for row in answered)
    counts = outcome.manifest["counts"]
    assert counts == {**counts, "total": ROWS, "succeeded": ROWS - len(nulls), "failed": len(nulls)}
    assert counts["by_error_code"] == {"template_error": len(nulls)}
    assert outcome.manifest["dataset"]["id_column"] == "id" and outcome.manifest["dataset"]["route"] == "chat"


def test_a_template_naming_a_column_the_table_lacks_fails_before_any_work(parquet_table, tmp_path):
    with pytest.raises(
        PreflightError, match=r"does not have: summary \(it has: id, title, text, shots, seen\)"
    ):
        run_job(_job(parquet_table, tmp_path / "out", template="{{ summary }}"), show_progress=False)
    assert not (tmp_path / "out" / "_staging").exists()


def test_a_jsonl_table_without_an_id_comes_back_in_input_order(tmp_path):
    lines = [json.dumps({"name": f"n{i}", "note": "é" * (i % 3)}) for i in range(300)]
    lines[17] = "{not json"
    lines[40] = json.dumps({"note": "no name"})
    path = tmp_path / "people.jsonl"
    path.write_text("\n".join(lines) + "\n")
    config = _job(
        path,
        tmp_path / "out",
        template="Greet {{ name }}",
        system=None,
        id_column=None,
        keep_columns=["name"],
    )
    run_job(config, show_progress=False)
    rows = read_jsonl(sorted((tmp_path / "out").glob("results-*.jsonl")))
    assert len(rows) == 300 and [row.get("name") for row in rows][:3] == ["n0", "n1", "n2"]
    assert set(rows[0]) == {"name", "content", "finish_reason", "prompt_tokens", "completion_tokens", "error"}
    assert rows[17]["error"]["code"] == "invalid_json" and rows[17]["name"] is None
    assert rows[40]["error"]["code"] == "template_error" and "no column name" in rows[40]["error"]["message"]


def test_a_dataset_job_killed_half_way_resumes_exactly_once(tmp_path):
    """README "Failure model", row "the driver is killed", for a dataset job: the resumed output is the
    uninterrupted one, byte for byte."""
    rows = 2000
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"r{(i * 7919) % rows:05d}", "q": f"q {i}"}) + "\n" for i in range(rows))
    )
    config = tmp_path / "job.yaml"
    config.write_text(
        json.dumps(
            {
                "job_id": "dataset-resume",
                # No request starts once half is staged (the hold): the kill lands mid-job on any box.
                "engine": {
                    "backend": "fake",
                    "fake": {
                        "output_tokens": 4,
                        "decode_seconds_per_token": 0.05,
                        "max_concurrency": 16,
                        "hold_while": str(tmp_path / "hold"),
                    },
                },
                "resources": {"cpus_per_engine": 0.5, "rows_per_task": 16},
                "output_options": {"rows_per_shard": 700, "staging_rows": 100},
                "dataset": {"template": "Answer {{ q }}", "id_column": "id"},
            }
        )
    )
    output = tmp_path / "out"
    command = run_command(path, output, config)
    staged_before = kill_driver_half_way(command, output, rows, hold=tmp_path / "hold")
    assert rows // 2 <= len(staged_before) < rows and not (output / "manifest.json").exists()
    nightshift_ok("resume", str(output), "--no-progress")
    resumed = read_jsonl(sorted(output.glob("results-*.jsonl")))
    assert [row["id"] for row in resumed] == [f"r{i:05d}" for i in range(rows)]
    clean = tmp_path / "clean"
    run_uninterrupted(path, clean, config)
    assert_same_shards(clean, output)
