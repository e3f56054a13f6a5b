"""The README's CPU install, as written, in a fresh virtualenv: build the wheel, run the commands of the block marked
`<!-- install:cpu -->` with the package name replaced by the wheel, then the example batch with the installed
`nightshift` console script. If the README's install section drifts from what works, this fails.

Between two commands the install is half done, as for a user who stopped there: at each such point `nightshift
doctor` must tell the truth about torch's builds (it reports a mismatch exactly when importing torchvision and
torchaudio fails), and `nightshift run` must stop, before any engine, with one line per problem naming its fix and
no traceback. After the last command doctor reports nothing that would fail a job.

The install test is slow: it takes a few minutes even from a local wheel cache, then the engine starts once.
"""

from __future__ import annotations

import json
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


# The checks `run` makes before any engine starts (pipeline.doctor.job_checks), by their doctor names.
RUN_CHECKS = ("engine", "engine stack", "torch", "embedded model")
# Imports torch and whichever of its companions is installed: exit 0 exactly when their builds agree.
IMPORT_TORCH_FAMILY = (
    "import importlib.util, torch\n"
    "for name in ('torchvision', 'torchaudio'):\n"
    "    if importlib.util.find_spec(name):\n"
    "        __import__(name)\n"
)


def _doctor(bin_dir: Path, env: dict, cwd: Path) -> tuple[int, list[dict]]:
    proc = subprocess.run(
        [str(bin_dir / "nightshift"), "doctor", "--json"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr
    findings = json.loads(proc.stdout)
    assert proc.returncode == (1 if any(f["status"] == "fail" for f in findings) else 0)
    return proc.returncode, findings


def _check_half_done_install(
    bin_dir: Path, env: dict, cwd: Path, step: int, after: str, example: Path
) -> None:
    """What a user who stopped after command `after` meets: a doctor that tells the truth about torch, and a run
    that stops at once with the fixes."""
    _, findings = _doctor(bin_dir, env, cwd)
    by_name = {f["name"]: f for f in findings}
    print(f"\n$ nightshift doctor  # after: {after}\n" + "\n".join(f"  {f}" for f in findings))

    imported = subprocess.run(
        [str(bin_dir / "python"), "-c", IMPORT_TORCH_FAMILY],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    torch = by_name["torch"]
    assert (torch["status"] == "fail") == (imported.returncode != 0), (
        f"after {after!r}: doctor says {torch}, importing torch's companions "
        f"{'failed' if imported.returncode else 'worked'}\n{imported.stderr[-2000:]}"
    )
    if torch["status"] == "fail" and "torchvision" in torch["detail"]:
        assert "operator torchvision::nms does not exist" in imported.stderr, imported.stderr[-2000:]

    blocking = [f for f in findings if f["status"] == "fail" and f["name"] in RUN_CHECKS]
    if blocking == [by_name.get("engine stack")]:
        return  # the CPU build on a GPU node: doctor fails it, a local run still runs (on the CPU)
    if not blocking:
        return
    out = cwd / f"out-after-step-{step}"
    proc = subprocess.run(
        [str(bin_dir / "nightshift"), "run", str(example), str(out), "--no-progress"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(f"$ nightshift run ...  # after: {after}\n{proc.stderr}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    for finding in blocking:
        if finding["name"] != "engine stack":
            assert any(finding["fix"] in line for line in errors), (finding, errors)
    assert not (out / "_staging").exists()  # stopped before any work


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

    example = REPO / "examples" / "chat.jsonl"
    for step, command in enumerate(commands):
        argv = shlex.split(command)
        assert argv[0] == "pip", f"the CPU block may only run pip: {command!r}"
        argv = [str(bin_dir / "python"), "-m", "pip", *(a.replace(PACKAGE, str(wheel), 1) for a in argv[1:])]
        _run(argv, env=env, cwd=tmp_path, timeout=1800)
        if step < len(commands) - 1:
            _check_half_done_install(bin_dir, env, tmp_path, step, command, example)

    # The install as documented: nothing a job needs is missing or mismatched.
    code, findings = _doctor(bin_dir, env, tmp_path)
    print("\n$ nightshift doctor  # the whole block\n" + "\n".join(f"  {f}" for f in findings))
    from cluster.detect import detect_node

    cpu_node = detect_node().vendor == "cpu"  # the CPU block on a GPU node: doctor rightly fails its stack
    assert [f for f in findings if f["status"] == "fail" and (cpu_node or f["name"] != "engine stack")] == []
    assert {f["name"]: f["status"] for f in findings}["embedded:minilm"] == "ok"

    # What runs below is the installed package, not the checkout.
    where = _run(
        [str(bin_dir / "python"), "-c", "import pipeline; print(pipeline.__file__)"],
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout

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
