"""nightshift as a Python call, with the fake engine: `pipeline.run` on a job, a pandas DataFrame and a pyarrow
Table answered in memory, a Ray Dataset answered and resumed, and a Ray the call started shut down after it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pandas as pd
import pyarrow as pa
import pytest

import pipeline
from pipeline.runtime.preflight import PreflightError
from tests.lines import chat_line

pytestmark = pytest.mark.usefixtures("local_ray")

FAKE = {"backend": "fake", "fake": {"output_tokens": 3}}
SMALL = {"num_engines": 1, "cpus_per_engine": 0.5, "rows_per_task": 16}


def test_run_takes_a_job_and_returns_its_typed_outcome(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join(chat_line(f"id-{i:03d}", f"question {i}") + "\n" for i in range(40)) + "{broken\n"
    )
    job = {
        "input": str(path),
        "output": str(tmp_path / "out"),
        "model": None,
        "engine": FAKE,
        "resources": SMALL,
    }
    result = pipeline.run(job)
    assert isinstance(result, pipeline.RunResult)
    assert (result.counts.total, result.counts.succeeded, result.counts.failed) == (41, 40, 1)
    assert [p.rsplit("/", 1)[-1] for p in result.results] == ["results-00000-of-00001.jsonl"]
    assert sum(1 for _ in open(result.results[0])) == 40 and sum(1 for _ in open(result.errors[0])) == 1
    with pytest.raises(PreflightError, match="holds a completed job"):
        pipeline.run(job)  # the same guarantees as the command: a finished output is not overwritten silently
    assert pipeline.run(job, overwrite=True).counts.succeeded == 40


def test_a_dataframe_comes_back_a_dataframe_in_its_order_with_its_answers():
    frame = pd.DataFrame(
        {
            "ticket": [f"t{i}" for i in range(50)],
            "text": [None if i == 7 else f"printer {i} broke" for i in range(50)],
        }
    )
    answered = pipeline.run_table(
        frame,
        job={"model": None, "engine": FAKE, "resources": SMALL},
        template="Triage: {{ text }}",
        max_tokens=3,
    )
    assert isinstance(answered, pd.DataFrame)
    assert list(answered["ticket"]) == list(frame["ticket"]) and list(answered.columns[:2]) == [
        "ticket",
        "text",
    ]
    assert answered["content"].notna().sum() == 49 and answered.loc[7, "error"]["code"] == "template_error"
    table = pipeline.run_table(
        pa.Table.from_pandas(frame.dropna()),
        job={"model": None, "engine": FAKE, "resources": SMALL},
        template="{{ text }}",
        id_column="ticket",
    )
    assert isinstance(table, pa.Table) and table.column("ticket").to_pylist() == sorted(
        frame.dropna()["ticket"]
    )


def test_a_ray_dataset_comes_back_a_ray_dataset_and_a_second_call_finds_it_done(tmp_path):
    import ray

    rows = ray.data.from_items([{"id": i, "q": f"question {i}"} for i in range(120)])
    output = str(tmp_path / "answers")
    job = {"model": None, "engine": FAKE, "resources": SMALL}
    answered = pipeline.run_dataset(rows, output=output, job=job, template="{{ q }}", id_column="id")
    assert isinstance(answered, ray.data.Dataset)
    got = answered.to_pandas()
    assert list(got["id"]) == list(range(120)) and got["content"].notna().all()
    assert json.loads((tmp_path / "answers" / "manifest.json").read_text())["counts"]["succeeded"] == 120


def test_a_ray_the_call_started_is_shut_down_when_it_returns(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(chat_line("a", "hello") + "\n")
    script = textwrap.dedent(
        f"""
        import ray, pipeline
        result = pipeline.run({{"input": {str(path)!r}, "output": {str(tmp_path / "out")!r}, "model": None,
                               "engine": {FAKE!r}, "resources": {SMALL!r}}}, warm=False)
        print(result.counts.succeeded, ray.is_initialized())
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["1", "False"]


def test_the_readme_example_answers_every_review():
    """examples/table.py, the README's Python example, on the fake engine (tests/e2e runs the same API on the real
    one through the command line)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "table.py"
    spec = importlib.util.spec_from_file_location("table_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    reviews = pd.read_json(path.with_name("reviews.jsonl"), lines=True)
    answered = example.sentiments(reviews, model=None, engine=FAKE, resources=SMALL)
    assert list(answered["id"]) == list(reviews["id"])
    errors = answered[answered["error"].notna()]
    assert list(errors["id"]) == [104] and errors.iloc[0]["error"]["code"] == "template_error"
    assert answered.drop(errors.index)["content"].str.len().gt(0).all()
