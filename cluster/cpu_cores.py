"""CPU cores for CPU engines: each engine on a node computes on cores no other engine uses.

Ray reserves CPUs by count, not by id, and vLLM's CPU backend binds its compute threads by itself: its default
(`VLLM_CPU_OMP_THREADS_BIND=auto`) picks cores from the NUMA layout without knowing of any other engine, so every
engine on a node lands on the same first core(s) — two engines on a 2-core box share core 0 while core 1 stays
"reserved" for both. An engine that knows its cores passes them to vLLM as `VLLM_CPU_OMP_THREADS_BIND`.

Cores are claimed with one advisory lock file per core in a node-wide directory: the lock lives exactly as long as
the process holding it (a killed engine actor frees its cores with no clean-up step, and its replacement can take
them), engines of different jobs on the same node see each other's claims, and there is no coordinator to reach.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterable
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


def _try_lock(directory: Path, core: int) -> int | None:
    handle = os.open(directory / f"core-{core}.lock", os.O_RDWR | os.O_CREAT, 0o666)
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
        directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            directory.chmod(0o1777)  # other users' engines on a shared node claim here too
        for core in sorted(usable_cpus() if candidates is None else candidates):
            handle = _try_lock(directory, core)
            if handle is not None:
                claim.cores.append(core)
                claim._handles.append(handle)
                if len(claim.cores) == count:
                    return claim
    except OSError:
        pass  # no writable lock directory: the engine falls back to vLLM's own binding
    claim.release()
    return None
