"""The README's CPU install, as written, in a fresh virtualenv: build the wheel, run the commands of the block marked
`<!-- install:cpu -->` with the package name replaced by the wheel, then the example batch with the installed
`nightshift` console script. If the README's install section drifts from what works, this fails.

The install test is slow: it takes a few minutes even from a local wheel cache, then the engine starts once.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARKER = "<!-- install:cpu -->"
PACKAGE = "nightshift-batch"
# What the wheel build needs from the repository; nothing else is copied (no venv, no caches, no outputs).
SOURCES = ("pyproject.toml", "README.md", "pipeline", "cluster")
SUMMARY = re.compile(r"^rows\s+(\d+) total, (\d+) ok, (\d+) failed", re.MULTILINE)


def documented_cpu_commands(readme: str) -> list[str]:
    """The commands of the fenced block right after the `install:cpu` marker, comments and blank lines dropped."""
    lines = readme.splitlines()
    assert lines.count(MARKER) == 1, f"README.md must mark exactly one block with {MARKER}"
    start = lines.index(MARKER) + 1
    assert lines[start].startswith("```"), f"the line after {MARKER} must open a fenced block"
    end = lines.index("```", start + 1)
    commands = [line.strip() for line in lines[start + 1 : end]]
    return [c for c in commands if c and not c.startswith("#")]


def test_readme_block_is_found() -> None:
    commands = documented_cpu_commands((REPO / "README.md").read_text())
    assert commands and all(shlex.split(c)[0] == "pip" for c in commands), commands
    assert any(PACKAGE in c for c in commands)


def _run(argv: list[str], *, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{shlex.join(argv)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
        f"--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc


def _wheel(tmp: Path, env: dict) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    dist = tmp / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(dist), str(src)],
        env=env,
        cwd=tmp,
        timeout=600,
    )
    (wheel,) = dist.glob("nightshift_batch-*.whl")
    return wheel


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_documented_cpu_install_runs_the_example(tmp_path: Path) -> None:
    commands = documented_cpu_commands((REPO / "README.md").read_text())
    # A clean environment for everything below: no PYTHONPATH pointing at the checkout, no active virtualenv.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["NIGHTSHIFT_HOME"] = str(tmp_path / "home")

    wheel = _wheel(tmp_path, env)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], env=env, cwd=tmp_path, timeout=300)
    bin_dir = venv / "bin"
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)

    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "pip", f"the CPU block may only run pip: {command!r}"
        argv = [str(bin_dir / "python"), "-m", "pip", *(a.replace(PACKAGE, str(wheel), 1) for a in argv[1:])]
        _run(argv, env=env, cwd=tmp_path, timeout=1800)

    # What runs below is the installed package, not the checkout.
    where = _run(
        [str(bin_dir / "python"), "-c", "import pipeline; print(pipeline.__file__)"],
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout

    example = REPO / "examples" / "chat.jsonl"
    out = tmp_path / "out"
    proc = _run(
        [str(bin_dir / "nightshift"), "run", str(example), str(out)], env=env, cwd=tmp_path, timeout=1200
    )

    summary = SUMMARY.search(proc.stdout)
    assert summary, proc.stdout
    total, ok, failed = map(int, summary.groups())
    lines = [line for line in example.read_text().splitlines() if line.strip()]
    assert total == len(lines) and ok + failed == total
    assert ok > 0
    assert (out / "manifest.json").is_file()
    results = [line for p in out.glob("results-*.jsonl") for line in p.read_text().splitlines() if line]
    errors = [line for p in out.glob("errors-*.jsonl") for line in p.read_text().splitlines() if line]
    assert (len(results), len(errors)) == (ok, failed)
    assert len(results) + len(errors) == len(lines)
