"""Thousands of hostile lines through a whole job (fake engine): it completes, and lines = results + errors."""

from __future__ import annotations

import pytest

from pipeline.config import JobConfig
from pipeline.runtime.job import run_job
from tests.fuzz_lines import hostile_corpus
from tests.lines import read_jsonl


@pytest.mark.usefixtures("local_ray")
def test_hostile_corpus_job_accounts_for_every_line(tmp_path):
    """README "Failure model", row "a bad line": thousands of them, each one record, and the job goes on."""
    lines = hostile_corpus(4000, seed=11)
    path = tmp_path / "hostile.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass") + b"\n")
    expected = sum(1 for line in path.read_bytes().split(b"\n") if line.strip())
    config = JobConfig.model_validate(
        {
            "input": str(path),
            "output": str(tmp_path / "out"),
            "engine": {"backend": "fake", "fake": {"output_tokens": 2}},
            "resources": {"cpus_per_engine": 0.5, "rows_per_task": 32},
            "output_options": {"rows_per_shard": 1000},
        }
    )
    outcome = run_job(config, show_progress=False)
    results = read_jsonl(outcome.output.glob("results-*.jsonl"))
    errors = read_jsonl(outcome.output.glob("errors-*.jsonl"))
    assert len(results) + len(errors) == expected == outcome.manifest["counts"]["total"]
    ids = [r["custom_id"] for r in results]
    assert len(ids) == len(set(ids))
    assert 1000 < len(results) < expected  # both kinds really occurred
