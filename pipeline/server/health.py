"""What `GET /healthz` and `GET /readyz` (api/health.py) answer: the API's own liveness and readiness, for probes and
load balancers.

Neither takes a key (probes carry none) and neither tells anything about tenants, files or paths.

- `/healthz` (liveness): the replica's HTTP app answers. Nothing else is touched, so it stays cheap and a slow
  database or cluster never gets a live replica restarted.
- `/readyz` (readiness): the replica can do its work. The state database takes a write — a committed transaction
  that rewrites its schema version with the value it has, so a read-only, full or locked disk, or a data dir that
  vanished, shows here and not in the next upload — and the Ray cluster the batches run on answers (one call to its
  GCS). Each check is bounded by READY_TIMEOUT_S; 503 with the reason of each failing check otherwise. Anyone may
  call it, as often as they like: the write (a sync to disk) runs at most once per READY_WRITE_EVERY_S, one at a
  time, and a call in between gets the last write's answer.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

# A probe's answer must come well within a Kubernetes probe's default timeout (1 s would be tight on a busy disk;
# give probes timeoutSeconds >= 5, as k8s/rayservice.yaml does).
READY_TIMEOUT_S = 2.0
# Probes come every few seconds (k8s/rayservice.yaml: 10 s); a caller hammering /readyz gets this write rate at most.
READY_WRITE_EVERY_S = 5.0
_last_writes: dict[Path, tuple[float, str | None]] = {}
_writing = threading.Lock()


def database_readiness(path: Path) -> str | None:
    """`database_problem`, written at most once per READY_WRITE_EVERY_S (and one at a time): the last answer in
    between."""
    with _writing:
        last = _last_writes.get(path)
        if last is not None and time.monotonic() - last[0] < READY_WRITE_EVERY_S:
            return last[1]
        problem = database_problem(path)
        _last_writes[path] = (time.monotonic(), problem)
        return problem


def database_problem(path: Path) -> str | None:
    """None when the database at `path` commits a write; else why not (never its path)."""
    try:
        # mode=rw: a missing file is a failure, not a new empty database.
        conn = sqlite3.connect(
            f"file:{path}?mode=rw", uri=True, timeout=READY_TIMEOUT_S, isolation_level=None
        )
        try:
            conn.execute("BEGIN IMMEDIATE")  # the write lock, waited for at most the timeout
            try:
                (version,) = conn.execute("PRAGMA user_version").fetchone()
                # A real write (a new page in the log, synced at commit) that changes nothing: under the write lock,
                # the version written is the version read.
                conn.execute(f"PRAGMA user_version = {int(version)}")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return f"the database takes no write: {exc}"
    return None


def ray_problem() -> str | None:
    """None when the Ray cluster this process is connected to answers; else why not."""
    import ray

    if not ray.is_initialized():
        return "not connected to a Ray cluster"
    from ray.experimental.internal_kv import internal_kv_get_gcs_client

    try:
        internal_kv_get_gcs_client().internal_kv_exists(
            b"nightshift-readyz", namespace=b"nightshift", timeout=READY_TIMEOUT_S
        )
    except Exception as exc:  # noqa: BLE001 - whatever it is, the cluster did not answer
        return f"the Ray cluster does not answer ({type(exc).__name__})"
    return None
