"""A fake child job for the job-process launcher (pipeline/runtime/hosting/launcher.py): a small program put where the
launcher finds Python (`sys.executable -m pipeline …`). It appends what it was given — its arguments, its
environment, the job file, its SIGINT disposition — as one JSON line to $FAKE_RECORD, and then does what
$FAKE_BEHAVIOUR says:

    exit:N            exit with code N at once
    abort-on-sigint   run until SIGINT, then end as a job's abort path does (exit 130)
    ignore-sigint     ignore SIGINT, as a stuck job would (only SIGKILL ends it)
    abort-once        the first run as abort-on-sigint, every later one exit:0 (a job stopped by a window's close,
                      then resumed to its end)
"""

from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path

import pytest

FAKE_CHILD = """#!{python}
import json, os, signal, sys, time

# What `python -m pipeline` does first.
from pipeline.runtime.hosting.launcher import follow_launcher
follow_launcher()

given = dict(os.environ)  # what the launcher gave it, before the defaults below
for name, value in {defaults!r}.items():
    os.environ.setdefault(name, value)
argv = sys.argv[1:]
job_file = argv[argv.index("--config") + 1] if "--config" in argv else None
record = {{
    "argv": argv,
    "env": given,
    "job_file": open(job_file).read() if job_file else None,
    "sigint": str(signal.getsignal(signal.SIGINT)),
}}
path = os.environ["FAKE_RECORD"]
behaviour = os.environ.get("FAKE_BEHAVIOUR", "exit:0")
if behaviour == "abort-once":
    behaviour = "exit:0" if os.path.exists(path) else "abort-on-sigint"
if behaviour == "ignore-sigint":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
try:
    print("fake job started", flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\\n")  # the test waits for this line: the child is ready for signals
    if behaviour.startswith("exit:"):
        sys.exit(int(behaviour[5:]))
    time.sleep(30)
except KeyboardInterrupt:
    print("interrupted; finished rows are kept", flush=True)
    sys.exit(130)
sys.exit(3)
"""


def install_fake_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, defaults: dict[str, str] | None = None
) -> Path:
    """Make `sys.executable` the fake child for this test. `defaults`: $FAKE_RECORD and $FAKE_BEHAVIOUR for a
    child whose launcher passes no such variable (a job gets only the variables a job needs)."""
    program = tmp_path / "fake-python"
    program.write_text(FAKE_CHILD.format(python=sys.executable, defaults=defaults or {}))
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sys, "executable", str(program))
    return program


def wait_for_records(path: Path, count: int, timeout: float = 20.0) -> list[dict]:
    """The first `count` records of the fake children, once that many have started."""
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return [json.loads(line) for line in lines]
        assert time.monotonic() < deadline, f"{len(lines)} of {count} fake children started"
        time.sleep(0.02)
