"""A clean `nightshift run` prints the summary and its own log lines, nothing else: no warnings from libraries
about our own calls, no C++ log lines from Ray's core. (The real engine's run: tests/e2e/test_run_real_engine.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.lines import chat_line, write_lines
from tests.runs import foreign_lines


def _fake_run(tmp_path, rows: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`nightshift run` of `rows` chats on the fake engine, as a user starts it (Python's default warning filters)."""
    path = write_lines(tmp_path / "in.jsonl", [chat_line(f"c-{i:02d}", f"question {i}") for i in range(rows)])
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "run", str(path), str(tmp_path / "out"), "--engine", "fake"],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in env.items() if k != "PYTHONWARNINGS"},
    )


def test_a_clean_run_prints_nothing_foreign(tmp_path, embedded_model):
    done = _fake_run(tmp_path, 20, dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "20 total, 20 ok" in done.stdout
    assert foreign_lines(done.stdout, done.stderr) == [], done.stderr


def _processes_with(marker: str) -> list[str]:
    """Processes whose environment holds `marker` (every process a run starts inherits its environment: Ray's
    node processes, its workers, their engines), as `pid command`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid} {command[:120]}")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def test_a_run_leaves_no_process_of_its_ray_behind(tmp_path, embedded_model):
    """`nightshift run` ends its private Ray itself and exits without the interpreter's teardown (pipeline/cli.py:
    main): every process the run started is gone once the command has returned, and the autoscaler's monitor, killed
    rather than asked to stop, reports nothing."""
    import time

    marker = f"NIGHTSHIFT_TEST_RUN_MARK={os.getpid()}-{tmp_path.name}"
    key, value = marker.split("=", 1)
    # A private Ray of its own (no RAY_ADDRESS): the processes it starts are the run's.
    done = _fake_run(
        tmp_path, 12, {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, key: value}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "12 total, 12 ok" in done.stdout  # the summary was flushed before the quick exit
    assert "autoscaler" not in done.stdout + done.stderr
    assert foreign_lines(done.stdout, done.stderr) == [], done.stderr
    # Ray's workers may take a moment to notice their raylet is gone; none may stay.
    deadline = time.monotonic() + 30
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_with(marker) == []
