"""Fake vendor tools on PATH: tiny shell scripts that print a recorded output, for detection tests."""

from __future__ import annotations

import shlex
import shutil
import stat
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "smi"


class FakeTools:
    """Installs executables into a private bin directory that is the *only* PATH entry.

    Nothing else is on PATH, so a real nvidia-smi or amd-smi on the test machine can never leak in;
    the scripts therefore call `cat` by absolute path.
    """

    def __init__(self, bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bin_dir = bin_dir
        self.calls_log = bin_dir / "calls.log"
        self.cat = shutil.which("cat") or "/bin/cat"
        bin_dir.mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv("PATH", str(bin_dir))

    def install(self, name: str, body: str) -> Path:
        """A script `name` running `body` (POSIX sh), logging its argv to calls.log first."""
        script = self.bin_dir / name
        log = shlex.quote(str(self.calls_log))
        script.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n{body}\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return script

    def prints(self, name: str, fixture: str, exit_code: int = 0) -> Path:
        """A tool that prints a recorded fixture file and exits with `exit_code`."""
        return self.install(name, f"{self.cat} {shlex.quote(str(FIXTURES / fixture))}\nexit {exit_code}")

    def fails(self, name: str, message: str, exit_code: int = 1) -> Path:
        return self.install(name, f"echo {shlex.quote(message)}\nexit {exit_code}")

    def calls(self) -> list[str]:
        return self.calls_log.read_text().splitlines() if self.calls_log.exists() else []
