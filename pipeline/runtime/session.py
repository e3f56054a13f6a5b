"""The Ray session a job runs in: start a private instance or join a cluster, quietly, with the settings Ray Data
needs for a batch job; whether work on the driver's disk must stay on the driver's node; and a thread helper for
work that overlaps Ray's start-up."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any


def start_ray(address: str | None) -> None:
    import contextlib
    import logging
    import os

    import ray
    from ray.data import DataContext

    from pipeline.observe.logs import quiet_native_stderr

    if not ray.is_initialized():
        # Ray's C++ core writes errors no user can act on to the terminal: e.g. every Ray Data actor pool makes it
        # log that the actors' constructor arguments live in the object store (ray-project/ray#53727). Fatal only;
        # the core announces that setting on stderr as it starts, so the start runs with native stderr quieted
        # (Python's own output is untouched). A level the user set is theirs, and so is its announcement.
        ours = "RAY_BACKEND_LOG_LEVEL" not in os.environ
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
        with quiet_native_stderr() if ours else contextlib.nullcontext():
            # "local" starts a private instance: never attach by accident to a cluster someone else started here.
            ray.init(
                address=address or "local",
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.ERROR,
            )
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.enable_auto_log_stats = False
    # Results are staged and sorted at the end; waiting for input order would hold every batch behind the slowest.
    ctx.execution_options.preserve_order = False
    # Without this, engines asking for resources no node has would wait forever in silence.
    ctx.wait_for_min_actors_s = 300


def must_pin_to_driver(local: bool, nodes: Sequence[Mapping[str, Any]], driver: str) -> bool:
    """Whether work that reads or writes a path on the driver's disk (`local`) must run on the driver's node
    (`driver`, a Ray node id): only when a live node of the cluster (`ray.nodes()` entries) is on another host, which
    cannot reach that disk. Nodes on the driver's host can (a multi-node cluster of one machine, as in tests)."""
    if not local:
        return False
    alive = [n for n in nodes if n.get("Alive", True)]
    here = next((n["NodeManagerAddress"] for n in alive if n["NodeID"] == driver), None)
    return any(n["NodeManagerAddress"] != here for n in alive)


class InBackground:
    """Run a function on a daemon thread (a Ctrl-C must not wait for it); `result()` joins and re-raises."""

    def __init__(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None

        def target() -> None:
            try:
                self._value = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller by result()
                self._error = exc

        self._thread = threading.Thread(
            target=target, name=getattr(fn, "__name__", "background"), daemon=True
        )
        self._thread.start()

    def wait(self, timeout: float) -> bool:
        """Whether it has finished, waiting at most `timeout` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
