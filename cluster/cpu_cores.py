"""CPU cores for CPU engines: each engine on a node computes on cores no other engine uses.

Ray reserves CPUs by count, not by id, and vLLM's CPU backend binds its compute threads by itself: its default
(`VLLM_CPU_OMP_THREADS_BIND=auto`) picks cores from the NUMA layout without knowing of any other engine, so every
engine on a node lands on the same first core(s) — two engines on a 2-core box share core 0 while core 1 stays
"reserved" for both. An engine that knows its cores passes them to vLLM as `VLLM_CPU_OMP_THREADS_BIND`.

Cores are claimed with one advisory lock file per core in a node-wide directory: the lock lives exactly as long as
the process holding it (a killed engine actor frees its cores with no clean-up step, and its replacement can take
them), engines of different jobs on the same node see each other's claims, and there is no coordinator to reach.
Start-up slots (`start_slot`) use the same kind of lock: how many CPU engines of a node import vLLM at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Node-wide, so every process on the node (any job, any Ray session) sees the same locks.
LOCK_DIR_ENV = "NIGHTSHIFT_CPU_LOCK_DIR"


def lock_dir() -> Path:
    return Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "nightshift-cpu-cores")


def usable_cpus() -> list[int]:
    """CPU ids this process may run on (its affinity mask: a container's or taskset's limits included)."""
    return sorted(os.sched_getaffinity(0))


@dataclass
class CoreClaim:
    """Cores held by this process until `release()` or its exit."""

    cores: list[int]
    _handles: list[int] = field(default_factory=list, repr=False)

    @property
    def omp_bind(self) -> str:
        """The cores in vLLM's `VLLM_CPU_OMP_THREADS_BIND` form for one rank ('0,1,5')."""
        return ",".join(str(core) for core in self.cores)

    def release(self) -> None:
        for handle in self._handles:
            with contextlib.suppress(OSError):
                os.close(handle)  # closing the descriptor drops its lock
        self._handles.clear()


def _shared_lock_dir(directory: Path) -> Path:
    """`directory`, created and open to every user (other users' engines on a shared node lock here too); raises
    OSError when it cannot be made."""
    directory.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        directory.chmod(0o1777)
    return directory


def _try_lock(path: Path) -> int | None:
    """The descriptor holding `path`'s lock, or None when another live process holds it."""
    handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(handle)
        return None
    return handle


def claim_cores(
    count: int, candidates: Iterable[int] | None = None, directory: Path | None = None
) -> CoreClaim | None:
    """Claim `count` cores no other live claimant holds, lowest ids first; None (nothing held) if too few are free.

    Taking the lowest free ids keeps a lone engine where vLLM's own binding would put it (core 0 first), so a
    single-engine job behaves exactly as vLLM does unclaimed.
    """
    if count < 1:
        return None
    directory = directory or lock_dir()
    claim = CoreClaim([])
    try:
        _shared_lock_dir(directory)
        for core in sorted(usable_cpus() if candidates is None else candidates):
            handle = _try_lock(directory / f"core-{core}.lock")
            if handle is not None:
                claim.cores.append(core)
                claim._handles.append(handle)
                if len(claim.cores) == count:
                    return claim
    except OSError:
        pass  # no writable lock directory: the engine falls back to vLLM's own binding
    claim.release()
    return None


def start_slots() -> int:
    """How many CPU engines on a node start at once: half its usable cores, at least one.

    Starting an engine is mostly single-threaded Python (vLLM's imports, seconds of CPU each). Engines that claim
    every core of a small node and start together share those cores with each other and with ingest, so all of
    them reach their first token late; started a few at a time, the first ones compute while the rest start.
    """
    return max(1, len(usable_cpus()) // 2)


@contextlib.contextmanager
def start_slot(
    slots: int | None = None,
    directory: Path | None = None,
    poll_s: float = 0.2,
    wait_at_most_s: float = 120.0,
) -> Iterator[int | None]:
    """Hold one of the node's `slots` start-up slots (default `start_slots()`) for the block, waiting for one to
    free. Yields the slot's number, or None when there is no lock directory to use or no slot freed within
    `wait_at_most_s` (the start then goes ahead without one: a holder stuck in its imports must not hold up every
    engine of the node). A holder that dies frees its slot with its process, like a core claim."""
    slots = slots or start_slots()
    directory = directory or lock_dir()
    deadline = time.monotonic() + wait_at_most_s
    slot: int | None = None
    handle: int | None = None
    try:
        _shared_lock_dir(directory)
        while True:
            for slot in range(slots):
                if (handle := _try_lock(directory / f"start-{slot}.lock")) is not None:
                    break
            if handle is not None or time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
    except OSError:
        pass  # no usable lock directory
    try:
        yield slot if handle is not None else None
    finally:
        if handle is not None:
            os.close(handle)  # closing the descriptor drops its lock
