"""A clean `nightshift run` prints the summary and its own log lines, nothing else: no warnings from libraries
about our own calls, no C++ log lines from Ray's core. (The real engine's run: tests/e2e/test_run_real_engine.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import chat_line, foreign_lines, write_lines


def test_a_clean_run_prints_nothing_foreign(tmp_path, embedded_model):
    path = write_lines(tmp_path / "in.jsonl", [chat_line(f"c-{i:02d}", f"question {i}") for i in range(20)])
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", str(path), str(tmp_path / "out"), "--engine", "fake"],
        capture_output=True,
        text=True,
        timeout=600,
        # Python's default warning filters, as a user has them.
        env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "20 total, 20 ok" in done.stdout
    assert foreign_lines(done.stdout, done.stderr) == [], done.stderr
