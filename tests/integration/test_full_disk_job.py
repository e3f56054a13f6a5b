"""README "Failure model", row "the output's disk fills up": a CLI job whose OUTPUT is on a disk that fills — while
its engines stage rows, or while finalize writes the shards — stops with exit code 75 and one line that says the disk
is full, where the finished rows are and what completes the job; once space returns, `nightshift resume` does: every
input line exactly once. The disk is a tmpfs the test mounts and fills with a file (tests/disks.py), so each write
fails with the kernel's own ENOSPC."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.io.full_disk import EXIT_DISK_FULL
from tests.disks import MiB, fill, make_room, small_filesystem
from tests.failure_figures import record
from tests.lines import chat_line, read_job_output, read_jsonl, write_lines

ROWS = 3000
# Room left on the disk when the job starts. The staged checkpoint (Parquet) of these rows takes a few hundred KiB,
# their JSONL shards about 1.5 MiB: 96 KiB stops the job while it stages, 1 MiB while finalize writes.
ROOM = {"staging": 96 * 1024, "finalize": 1 * MiB}


def nightshift(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("phase", list(ROOM))
def test_a_job_stopped_by_a_full_disk_says_so_and_resume_completes_it(tmp_path, phase):
    lines = [chat_line(f"row-{i:05d}", f"question {i} " + "q" * 300, max_tokens=64) for i in range(ROWS)]
    source = write_lines(tmp_path / "in.jsonl", lines)
    with small_filesystem(tmp_path / "disk", 16 * MiB) as disk:
        fill(disk, leave_bytes=ROOM[phase])
        out = disk / "out"
        stopped = nightshift("run", str(source), str(out), "--engine", "fake", "--no-progress")

        assert stopped.returncode == EXIT_DISK_FULL, stopped.stderr[-3000:]
        said = stopped.stderr.strip().splitlines()[-1]
        assert said.startswith("error: no space left on the disk"), said
        assert f"`nightshift resume {out}`" in said and "OUTPUT/_staging/" in said, said
        staged = out / "_staging"
        assert (staged / "job.json").exists()
        if phase == "staging":
            assert not (staged / "finalize").exists() and not list(out.glob("results-*"))
        else:
            assert (staged / "finalize" / "plan.json").exists()

        make_room(disk)
        resumed = nightshift("resume", str(out), "--no-progress")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        _, errors, manifest = read_job_output(out)
        written = [row["custom_id"] for row in read_jsonl(out.glob("results-*.jsonl"))]
        assert sorted(written) == [f"row-{i:05d}" for i in range(ROWS)] and errors == {}  # each row once
        assert manifest["counts"]["succeeded"] == ROWS and not staged.exists()
    record(
        f"the output's disk full while {'staging rows' if phase == 'staging' else 'finalizing'}, then `nightshift resume`",
        injected=1,
        input_lines=ROWS,
        output_ids=written,
    )
