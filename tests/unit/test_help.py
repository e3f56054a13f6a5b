"""Every `--help` runs: each `nightshift` command and subcommand, the console entry itself, and each bench script.

Both lists are discovered, not written down: the commands from the typer app (recursively through its groups, so
`nightshift node ...` and any command added later are covered), the benches by globbing bench/*.py for a
`__main__` entry. A help text that cannot be rendered (argparse %-formats every argument's help, so a literal `%`
in one is a traceback) fails here instead of in a user's hands."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from pipeline.cli import app

ROOT = Path(__file__).resolve().parents[2]
# Seconds one child Python gets to print a help; it takes well under one on an idle box.
HELP_TIMEOUT = 60
# What `nightshift --help` must not import: seconds of start-up each (pipeline/cli.py imports them in commands).
HEAVY_MODULES = ("ray", "vllm", "torch", "transformers", "pyarrow")


def _command_paths(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The command's path and its subcommands' paths, depth first. A group is told by its `list_commands` rather
    than by class: typer ships its own copy of click, whose groups are no `click.Group`."""
    yield path
    if hasattr(command, "list_commands"):
        ctx = command.context_class(command, info_name=path[-1] if path else "nightshift")
        for name in command.list_commands(ctx):
            yield from _command_paths(command.get_command(ctx, name), (*path, name))


COMMANDS = list(_command_paths(typer.main.get_command(app)))


def _bench_scripts() -> list[Path]:
    entry = re.compile(r"""^if __name__ == ["']__main__["']\s*:""", re.MULTILINE)
    return sorted(path for path in (ROOT / "bench").glob("*.py") if entry.search(path.read_text()))


BENCHES = _bench_scripts()


def test_discovery_reaches_groups_and_benches():
    # An empty or flat list would let every test below pass on nothing.
    assert len(COMMANDS) > 2 and any(len(path) == 2 for path in COMMANDS), COMMANDS
    assert ("node", "detect") in COMMANDS  # cluster/cli.py's commands, mounted as `nightshift node`
    assert BENCHES and ROOT / "bench" / "shared_prefix.py" in BENCHES, BENCHES


@pytest.mark.parametrize("path", COMMANDS, ids=lambda path: " ".join(("nightshift", *path)))
def test_command_help(path):
    result = CliRunner().invoke(app, [*path, "--help"], prog_name="nightshift", env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output + repr(result.exception)
    usage = " ".join(("Usage: nightshift", *path))
    assert re.search(rf"^\W*{re.escape(usage)}( |$)", result.output, re.MULTILINE), result.output


def test_console_entry_help_is_light():
    """`python -m pipeline --help`, the path the `nightshift` script takes (pipeline.cli:main and its exit): it
    prints the usage and imports none of the engine stack, so it stays instant."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pipeline", "--help"],
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "Usage: nightshift [OPTIONS] COMMAND" in proc.stdout, proc.stdout
    # -X importtime: one `import time: self | cumulative | module` line on stderr per module imported.
    imported = {
        line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")
    }
    heavy = sorted(name for name in imported if name.split(".")[0] in HEAVY_MODULES)
    assert not heavy, f"`nightshift --help` imports {heavy}"


@pytest.fixture(scope="module")
def bench_helps() -> dict[Path, subprocess.CompletedProcess | subprocess.TimeoutExpired]:
    """`python bench/X.py --help` for every bench, run side by side: each is a child Python starting up."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "COLUMNS": "200",
    }

    def run(script: Path) -> subprocess.CompletedProcess | subprocess.TimeoutExpired:
        try:
            return subprocess.run(
                [sys.executable, str(script), "--help"],
                capture_output=True,
                text=True,
                timeout=HELP_TIMEOUT,
                env=env,
                cwd=ROOT,
            )
        except subprocess.TimeoutExpired as exc:
            return exc

    with ThreadPoolExecutor(max_workers=min(8, len(BENCHES))) as pool:
        return dict(zip(BENCHES, pool.map(run, BENCHES), strict=True))


@pytest.mark.parametrize("script", BENCHES, ids=lambda path: path.name)
def test_bench_help(script, bench_helps):
    proc = bench_helps[script]
    assert not isinstance(proc, subprocess.TimeoutExpired), (
        f"{script.name} --help: no answer in {HELP_TIMEOUT} s"
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "usage:" in proc.stdout.lower(), proc.stdout[-4000:] + proc.stderr[-4000:]
