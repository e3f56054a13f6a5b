"""Shared fixtures (the embedded model, an input file maker) and the suite's hooks: how pytest-xdist splits the
suite, the priority of the tests beside the real-engine ones, and the figures the tests recorded."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.lines import write_lines


@pytest.fixture(scope="session")
def embedded_model():
    """The embedded model, converted into NIGHTSHIFT_HOME on first use (about 20 s) and reused after that; one
    process converts it while the other test processes wait (the conversion is atomic, the wait saves the work)."""
    import fcntl
    import tempfile

    from pipeline.models import resolve_model

    with open(Path(tempfile.gettempdir()) / "nightshift-tests-model.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return resolve_model(None)


@pytest.fixture
def make_input(tmp_path):
    def make(lines: list[str], name: str = "input.jsonl") -> Path:
        return write_lines(tmp_path / name, lines)

    return make


# Parallel runs. `make test` runs the suite in two worker processes (pytest-xdist, `--dist loadgroup`). The
# real-engine tests (tests/e2e) run one after another in one worker: on average they keep about one and a half of
# this box's two cores busy, and two of them at once took longer than one after the other (as did a third worker
# beside them: the box was then the bottleneck of every tier). The other worker runs the other tiers beside them,
# whose time is mostly a child process importing, a cluster starting or a job waiting on its fake engine. What a
# worker shares with no other:
# - a module's tests stay together (a module-scoped fixture starts its cluster or server once), and so do the
#   tests of a fixture that starts something for many modules (the server tests' shared server);
# - each worker claims CPU cores for its engines as if it were a machine of its own (cluster/cpu_cores.py): a test
#   that asserts its engines' cores must not find them held by an engine of another worker.
# The longest units are handed out first, so that the short unit tests fill the end.
_TIERS = ("e2e", "server", "integration", "k8s", "unit")
_ONE_AFTER_ANOTHER = "e2e"
# Real-engine tests that run beside the others instead: the documented install spends most of its ten minutes in pip
# (one core) and starts its engines only at the end, so the other worker takes it first.
_BESIDE = ("tests/e2e/test_documented_install.py",)
_SHARED_BY_FIXTURE = {"server": "server-shared"}


def pytest_addoption(parser):
    parser.addoption(
        "--timeline",
        metavar="DIR",
        default=None,
        help="Write when each test started and ended (epoch seconds), one file per worker "
        "(DIR/timeline-<worker>.tsv): where the suite's time goes, and what ran beside what.",
    )


_TIMELINE: dict[str, object] = {"dir": None, "started": {}}


def pytest_runtest_logstart(nodeid, location):
    if _TIMELINE["dir"] is not None:
        _TIMELINE["started"][nodeid] = time.time()  # type: ignore[index]


def pytest_runtest_logfinish(nodeid, location):
    directory = _TIMELINE["dir"]
    if directory is None:
        return
    started = _TIMELINE["started"].pop(nodeid, None)  # type: ignore[union-attr]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(Path(str(directory)) / f"timeline-{worker}.tsv", "a") as out:
        out.write(f"{started or 0:.1f}\t{time.time():.1f}\t{nodeid}\n")


def pytest_configure(config):
    # Recorded where the tests run: in each xdist worker, or in the one process without xdist (the controller only
    # hears of its workers' tests).
    controller = bool(getattr(config.option, "numprocesses", None)) and not os.environ.get(
        "PYTEST_XDIST_WORKER"
    )
    if config.getoption("--timeline") and not controller:
        _TIMELINE["dir"] = Path(config.getoption("--timeline"))
        _TIMELINE["dir"].mkdir(parents=True, exist_ok=True)
    # Read by every raylet the tests start: BESIDE_ENGINES_NICENESS says why.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # A `nightshift up` of the developer's own must not take the suite's runs (tests of it ask for it by name).
    os.environ["NIGHTSHIFT_WARM"] = "0"
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        import tempfile

        os.environ["NIGHTSHIFT_CPU_LOCK_DIR"] = str(
            Path(tempfile.gettempdir()) / f"nightshift-cpu-cores-{worker}"
        )


# The worker beside the real-engine tests gives way to them. Their engines bind one compute thread to each core they
# claim, and a step waits for its slowest thread: a test process of the other tiers taking a core from one of them
# stalls the whole engine, not a core's worth of it. At a lower priority the other tiers run mostly on what the
# engines leave free (their imports use one core of two most of the time), with about a tenth of a busy core left to
# them: at the lowest priority a server test's Ray, which waits a fixed 30 s for its raylet, timed out while two
# engines computed. Ray starts its worker processes (engine actors, and the vLLM processes they start) 15 steps
# below their raylet by default (RAY_worker_niceness), which put every engine below the other worker's test
# processes; the suite's Ray workers keep the priority of the test that started their cluster instead (set in
# pytest_configure).
BESIDE_ENGINES_NICENESS = 10


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before the test's fixtures, so the clusters and processes they start inherit the priority.
    if os.environ.get("PYTEST_XDIST_WORKER") and _work_unit(item) != _ONE_AFTER_ANOTHER:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        if current < BESIDE_ENGINES_NICENESS:
            os.nice(BESIDE_ENGINES_NICENESS - current)


def _tier(item: pytest.Item) -> str | None:
    parts = Path(item.nodeid.split("::")[0]).parts
    return parts[1] if len(parts) > 2 and parts[1] in _TIERS else None


def _work_unit(item: pytest.Item) -> str:
    module = item.nodeid.split("::")[0]
    if _tier(item) == _ONE_AFTER_ANOTHER and module not in _BESIDE:
        return _ONE_AFTER_ANOTHER
    for fixture, group in _SHARED_BY_FIXTURE.items():
        if fixture in item.fixturenames:
            return group
    return module


def pytest_itemcollected(item):
    # Marked as each test is collected: pytest-xdist reads the groups in its own pytest_collection_modifyitems.
    if item.config.pluginmanager.hasplugin("xdist"):
        item.add_marker(pytest.mark.xdist_group(_work_unit(item)))


def pytest_collection_modifyitems(config, items):
    from tests.e2e.warm_cluster import JOIN_ORDER

    on_local_ray = {item.nodeid.split("::")[0] for item in items if "local_ray" in item.fixturenames}

    def rank(pair: tuple[int, pytest.Item]) -> tuple:
        index, item = pair
        tier, unit = _tier(item), _work_unit(item)
        module = item.nodeid.split("::")[0]
        return (
            _TIERS.index(tier) if tier else len(_TIERS),
            unit != _ONE_AFTER_ANOTHER,  # the first unit handed out: its worker runs nothing else before it
            unit not in _SHARED_BY_FIXTURE.values(),
            # The real-engine modules on the warm cluster last, in its order (tests/e2e/warm_cluster.py says why).
            JOIN_ORDER.index(module) if module in JOIN_ORDER else -1,
            # The modules of one private local Ray next to each other, so that it is handed on instead of started
            # again (tests/integration/conftest.py: local_ray).
            module not in on_local_ray,
            index,
        )

    items[:] = [item for _, item in sorted(enumerate(items), key=rank)]


# What the tests recorded (tests/failure_figures.py), gathered from their reports in the process that prints.
_RECORDED: dict[str, list] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Move what a test (or its fixtures) recorded onto the report of the phase that recorded it."""
    from tests.failure_figures import take_pending

    outcome = yield
    outcome.get_result().user_properties.extend(take_pending())


def pytest_runtest_logreport(report):
    for kind, value in report.user_properties:
        _RECORDED.setdefault(kind, []).append(value)


def pytest_terminal_summary(terminalreporter):
    """Print what the failure tests measured and the measurements other tests noted (tests/failure_figures.py)."""
    from tests.failure_figures import FIGURE, NOTE, figure_lines

    if _RECORDED.get(FIGURE):
        terminalreporter.write_sep("-", "failure figures (rows lost and duplicated must be 0)")
        for line in figure_lines(_RECORDED[FIGURE]):
            terminalreporter.write_line(line)
    if _RECORDED.get(NOTE):
        terminalreporter.write_sep("-", "measured")
        for text in _RECORDED[NOTE]:
            terminalreporter.write_line(text)
