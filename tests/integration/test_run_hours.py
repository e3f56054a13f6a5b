"""`nightshift run --hours`: the window closes mid-job (the job stops as on Ctrl-C, its staged rows kept), the next
opening comes (the test clock skips the day between), and the same process resumes the job to the end: the output
is what an uninterrupted run writes, and the rows of the first shift were not run again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fake_oracle import comparable, run_in_process
from tests.lines import chat_line

pytestmark = pytest.mark.timeout(240)

# 300 requests of 10 tokens at 0.05 s a token, 4 at a time: about 37 s of generation, which the first window's end
# (40 s after the job starts, Ray's start included) cuts.
FAKE = {"output_tokens": 4, "decode_seconds_per_token": 0.05, "max_concurrency": 4}


def test_a_window_that_closes_mid_job_and_reopens(tmp_path):
    source = tmp_path / "in.jsonl"
    lines = [chat_line(f"req-{i:04d}", f"question {i}", max_tokens=10) for i in range(300)]
    source.write_text("\n".join([*lines, "{not json"]) + "\n")
    job = {
        "engine": {"backend": "fake", "fake": FAKE},
        "resources": {"num_engines": 1, "cpus_per_engine": 0.5},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        # The clock starts 40 s before the window's end; waiting for the next opening skips the day between.
        "NIGHTSHIFT_TEST_CLOCK": "2025-03-10T22:00:20+00:00",
    }
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", str(source), str(out), "--config", str(tmp_path / "job.yaml"),
         "--hours", "22:00-22:01", "--timezone", "UTC", "--no-progress", "--log-format", "json"],
        capture_output=True, text=True, env=env, timeout=220,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(x) for x in done.stderr.splitlines() if x.startswith("{")]
    said = [e["event"] for e in events]
    assert said.count("window open: working") == 2, said
    closed = [e for e in events if e["event"].startswith("window closed")]
    assert len(closed) == 1 and closed[0]["opens_at"] == "2025-03-11T22:00:00+00:00"

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["total"] == 301 and manifest["counts"]["succeeded"] == 300
    recovery = manifest["recovery"]
    assert recovery["resumed"] and 0 < recovery["rows_from_earlier_runs"] < 300  # the first shift's rows kept
    results = [json.loads(x) for p in sorted(out.glob("results-*.jsonl")) for x in p.open()]
    errors = [json.loads(x) for p in sorted(out.glob("errors-*.jsonl")) for x in p.open()]
    expected, expected_errors = run_in_process(source, FAKE)
    assert [comparable(r) for r in results] == [comparable(r) for r in expected]
    assert [comparable(r) for r in errors] == [comparable(r) for r in expected_errors]
    assert not (out / "_staging").exists()
