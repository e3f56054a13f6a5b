"""Running nightshift and the bench scripts as a user does, and what a run leaves: the output a user cannot act
on, the rows engines staged before their driver was killed, shards compared byte for byte."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

# What a clean run may print on stderr: nightshift's own log lines (structlog's console format), nothing else.
_OWN_LOG_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z \[(debug|info|warning|error|critical) *\] "
)
# Lines that have shown up before, named so a failure says which came back: a Ray deprecation warning from our own
# call, Ray's C++ core (its log-level announcement, its actor-restart notice), vLLM's Triton notice on CPU.
KNOWN_NOISE = ("DeprecationWarning", "logging.cc", "core_worker.cc", "Triton")


def foreign_lines(stdout: str, stderr: str) -> list[str]:
    """Lines of a run's output that a user cannot act on: anything on stderr that is not one of our log lines,
    and any known noise anywhere."""
    lines = [line for line in stderr.splitlines() if line.strip() and not _OWN_LOG_LINE.match(line)]
    lines += [line for line in (stdout + "\n" + stderr).splitlines() if any(n in line for n in KNOWN_NOISE)]
    return lines


def run_bench_smoke(script: str, *args: str) -> subprocess.CompletedProcess:
    """A bench script of this tree (`bench/<script>`) in a child Python, as a user runs it; asserts it succeeded."""
    repo = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, str(repo / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=repo,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def engine_staged_ids(output: Path) -> set[str]:
    """The custom_ids engines have staged rows for under a local OUTPUT (results and engine-side errors)."""
    import pyarrow.parquet as pq

    ids: set[str] = set()
    for part in (Path(output) / "_staging").glob("*/*.parquet"):
        if part.parent.name in ("results", "errors") and not part.name.startswith("validate-"):
            ids.update(pq.read_table(part, columns=["custom_id"]).column("custom_id").to_pylist())
    return ids


def kill_driver_half_way(command: list[str], output: Path, rows: int, hold: Path | None = None) -> set[str]:
    """Start a `nightshift` driver, SIGKILL it once engines have staged half of `rows` ids under `output`, and return
    the staged ids once staging has settled (the dead driver's engines may stage a last chunk).

    `hold`: the fake engines' `hold_while` file (see `held_until_half_staged`), removed once staging has settled, for
    the resume."""
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    held_until_half_staged(driver, lambda: engine_staged_ids(output), rows, hold)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    staged = once_settled(lambda: engine_staged_ids(output))
    if hold is not None:
        hold.unlink()
    return staged


def held_until_half_staged(driver: subprocess.Popen, staged, rows: int, hold: Path | None) -> None:
    """Returns once `staged()` holds half of `rows` ids. With `hold` (the fake engines' `hold_while` file), the
    engines are held while each count is read and from the moment it reaches half: no request starts meanwhile (those
    running finish), so the job cannot run to its end under a slow read, nor before the kill lands, however long a
    loaded box takes."""
    deadline = time.monotonic() + 300
    while True:
        if hold is not None:
            hold.touch()
        if len(staged()) >= rows // 2:
            return
        assert driver.poll() is None, driver.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "the job never got half way"
        if hold is not None:
            hold.unlink()
        time.sleep(0.2)


def run_command(input_path: Path, output: Path, config: Path) -> list[str]:
    """`nightshift run INPUT OUTPUT -c CONFIG --no-progress` as a command line (for a driver a test kills)."""
    return [
        sys.executable,
        "-m",
        "pipeline",
        "run",
        str(input_path),
        str(output),
        "-c",
        str(config),
        "--no-progress",
    ]


def nightshift_ok(*args: str) -> None:
    """Run `python -m pipeline ARGS` to completion; fail with its stderr unless it exits 0."""
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]


def run_uninterrupted(input_path: Path | str, output: Path, config: Path) -> dict:
    """The job of the job file `config` run to its end in this process, on the test's Ray (the `local_ray`
    fixture), as the reference a killed-and-resumed run of it is compared with; returns its manifest. The same job
    id gives the same output ids; the fake engine's time model and failure injection are left out, as its answers do
    not depend on them (its time model only delays them)."""
    import json

    from pipeline.config import JobConfig
    from pipeline.runtime.job import run_job

    settings = json.loads(config.read_text())
    fake = settings["engine"]["fake"]
    for name in (
        "prefill_seconds_per_token",
        "decode_seconds_per_token",
        "hold_while",
        "call_log",
        "crash_on",
    ):
        fake.pop(name, None)
    job = JobConfig.model_validate({**settings, "input": str(input_path), "output": str(output)})
    return run_job(job, show_progress=False).manifest


def assert_same_shards(one: Path, other: Path) -> None:
    """The two outputs hold the same shard files, byte for byte."""
    names = sorted(p.name for p in one.glob("*-of-*.jsonl"))
    assert names == sorted(p.name for p in other.glob("*-of-*.jsonl"))
    for name in names:
        assert (one / name).read_bytes() == (other / name).read_bytes(), name


def once_settled(read, quiet_s: float = 3.0, timeout_s: float = 60.0):
    """What `read()` returns once it has not changed for `quiet_s` seconds (or when `timeout_s` is up): what staging
    holds after a driver is killed. Engines stage their own chunks, and the ones running when their driver died may
    stage a last chunk or two before Ray tears down the dead driver's actors."""
    value, since, deadline = read(), time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.5)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value
