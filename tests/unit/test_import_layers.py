"""Imports point downwards: each rule names a layer and what it must never import (at any depth of the module, so a
function-level import counts too). Read from the source with `ast`, nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _modules(*globs: str) -> list[Path]:
    return sorted({path for pattern in globs for path in ROOT.glob(pattern)})


# The seam between the runtime and the engines: the registry (base.py) and the fitting every backend shares. The
# backends are named in the registry ("module:Class") and imported by it when an engine is built.
ENGINE_SEAM = ("base", "fitting")
ENGINE_BACKENDS = tuple(
    f"pipeline.engines.{path.stem}"
    for path in sorted((ROOT / "pipeline" / "engines").glob("*.py"))
    if path.stem not in ("__init__", *ENGINE_SEAM)
)

# The bottom of the import graph: atomic local writes and this machine's nightshift home, defined in cluster/home.py
# (cluster/auth.py needs it, and cluster/ knows no pipeline/) and passed on by pipeline/local_files.py. Importing
# cluster.home runs cluster/__init__.py too, so that imports nothing either.
BOTTOM = ("pipeline/local_files.py", "cluster/home.py", "cluster/__init__.py")
ABOVE_THE_HOME = tuple(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in sorted((ROOT / "cluster").rglob("*.py"))
    if path.name != "__init__.py" and path.relative_to(ROOT) != Path("cluster/home.py")
)

# (the layer's files, the imports it must not make, why)
RULES = [
    (("cluster/**/*.py",), ("pipeline",), "cluster/ sits below the job: it knows no pipeline/"),
    (
        BOTTOM,
        ("pipeline", *ABOVE_THE_HOME),
        "the bottom of the import graph imports nothing of the project but the home",
    ),
    (("bench/**/*.py",), ("tests",), "a bench stands on the project alone, not on the test suite"),
    (
        ("pipeline/stages/**/*.py", "pipeline/protocol.py", "pipeline/endpoints/**/*.py"),
        ("ray", "vllm", "torch", "pipeline.runtime", "pipeline.engines"),
        "pure stages and the wire format run in a unit test without Ray or vLLM",
    ),
    (
        ("pipeline/media/**/*.py",),
        (
            "ray",
            "vllm",
            "torch",
            "pipeline.runtime",
            "pipeline.engines",
            "pipeline.server",
            "pipeline.config",
        ),
        "the media fetch policy is plain Python: the engines apply it, the config and the server set it",
    ),
    (
        ("pipeline/engines/**/*.py",),
        ("ray.data", "pipeline.runtime", "pipeline.io", "pipeline.observe", "pipeline.server", "cluster"),
        "engines are the seam: the runtime places them and hands them their cores",
    ),
    (
        (
            "pipeline/config.py",
            "pipeline/prices.py",
            "pipeline/hours.py",
            "pipeline/clock.py",
            "pipeline/local_files.py",
        ),
        ("pipeline.observe", "pipeline.runtime", "pipeline.server", "pipeline.cli"),
        "configuration sits below what reads it",
    ),
    (
        ("pipeline/io/**/*.py",),
        ("pipeline.runtime", "pipeline.stages", "pipeline.engines", "pipeline.server", "pipeline.cli"),
        "io/ knows no step of the job",
    ),
    (
        ("pipeline/observe/**/*.py",),
        ("pipeline.runtime", "pipeline.server", "pipeline.cli"),
        "observers read state and never drive the job",
    ),
    (
        ("pipeline/runtime/**/*.py",),
        ("pipeline.server", "pipeline.cli"),
        "the job knows nothing of the server or the command line that start it",
    ),
    (
        # (the runtime's files, globbed apart from the rule above so each rule keeps its own test id)
        ("pipeline/runtime/*.py", "pipeline/runtime/*/**/*.py"),
        ENGINE_BACKENDS,
        "the runtime knows the engines only through the seam (engines/base.py's registry, engines/fitting.py)",
    ),
]


@pytest.mark.parametrize("globs,forbidden,why", RULES, ids=[rule[0][0] for rule in RULES])
def test_imports_point_downwards(globs, forbidden, why):
    files = _modules(*globs)
    assert files, f"no files match {globs}"
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in sorted(_imports(path))
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]
    assert not bad, f"{why}:\n" + "\n".join(bad)
