"""Test helpers live in modules of their own: no module of tests/ or bench/ imports from a test module (`test_*`) or
from a conftest. Read from the source with `ast`, nothing is imported; every import counts, at any depth.

Pytest imports a test module under a name of its own choosing (`test_planner`, the directory on sys.path), so
`from tests.unit.test_planner import ...` runs the module a second time, as another module; and a conftest is for
fixtures and hooks, which pytest hands to the tests below it without an import. Helpers (request-line builders, the
server harness, synthetic models, ...) are imported from helper modules, e.g. tests/lines.py or
tests/server/harness.py; a conftest imports them for its fixtures like any test does.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _is_test_or_conftest(module: str) -> bool:
    return any(part.startswith("test_") or part == "conftest" for part in module.split("."))


def offending_imports(source: str, local_names: set[str]) -> list[tuple[int, str]]:
    """(line, import) of each import of a test module or a conftest in `source`. An import is of this tree's tests
    when it is relative, under `tests.`, or of a top-level name in `local_names` (a test module or conftest that
    pytest's sys.path entries make importable bare, as `test_planner` or `conftest`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules, relative = [alias.name for alias in node.names], False
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            # `from tests.unit import test_planner` imports the module test_planner.
            modules = [base, *(f"{base}.{alias.name}".lstrip(".") for alias in node.names)]
            relative = node.level > 0
        else:
            continue
        ours = [m for m in modules if m and (relative or m.split(".")[0] in ("tests", *local_names))]
        if any(_is_test_or_conftest(m) for m in ours):
            found.append((node.lineno, ast.unparse(node)))
    return found


def _local_names() -> set[str]:
    return {path.stem for path in (ROOT / "tests").rglob("*.py") if _is_test_or_conftest(path.stem)}


def test_no_module_imports_a_test_module_or_a_conftest():
    local_names = _local_names()
    files = sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")])
    offending = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for path in files
        for line, text in offending_imports(path.read_text(), local_names)
    ]
    assert not offending, (
        "import helpers from a helper module of their own (not named test_*, not a conftest), not from a test "
        "module or a conftest:\n" + "\n".join(offending)
    )


def test_the_check_finds_each_way_of_importing_a_test_module_or_a_conftest():
    local_names = {"test_planner", "conftest"}
    offending = [
        "from tests.server.test_openai_client import FINAL",
        "from tests.conftest import chat_line",
        "from tests.server.conftest import KEY_A, Server",
        "from tests.unit import test_planner",
        "import tests.unit.test_planner",
        "from .conftest import JOB",
        "from . import test_planner",
        "from test_planner import make_model",
        "import conftest",
        "def helper():\n    from tests.conftest import chat_line\n",
    ]
    for source in offending:
        assert offending_imports(source, local_names), source
    allowed = [
        "from tests.lines import chat_line",
        "from tests.server.harness import KEY_A, Server",
        "from tests.integration.storage_fixtures import moto_s3",
        "from fake_smi import FakeTools",
        "from typer.testing import CliRunner",
        "from ray._private import test_utils",  # not this tree's
        "import pytest",
    ]
    for source in allowed:
        assert not offending_imports(source, local_names), source
