"""The real `nightshift` command line, run in a subprocess as users run it."""

from __future__ import annotations

import os
import subprocess
import sys

NIGHTSHIFT = [sys.executable, "-m", "pipeline"]


def run_cli(*args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real `nightshift` command line in a subprocess, as users do."""
    return subprocess.run(
        [*NIGHTSHIFT, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
