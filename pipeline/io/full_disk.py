"""A full disk, recognised wherever it surfaces: raised here, the cause of another error, or carried back by Ray from
the task or engine actor that met it. A full disk is not the job's fault and loses nothing (every finished row stays
staged): the CLI says so and exits EXIT_DISK_FULL, the Batch API answers 507."""

from __future__ import annotations

import errno
import sqlite3

# The filesystem's "no space left" and a quota's "disk quota exceeded".
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_SQLITE_FULL = getattr(sqlite3, "SQLITE_FULL", 13)
# sysexits.h's EX_TEMPFAIL: the job can be completed later (`nightshift resume`) once space returns.
EXIT_DISK_FULL = 75


def disk_full_cause(exc: BaseException) -> OSError | None:
    """The OSError in `exc`'s chain that says a disk is full, or None. Ray keeps a remote error's original
    exception as `.cause` of its RayTaskError (an engine actor staging rows, a finalize task writing a shard)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return current
        cause = getattr(current, "cause", None)
        pending += [
            current.__cause__,
            current.__context__,
            cause if isinstance(cause, BaseException) else None,
        ]
    return None


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` says a disk is full: the filesystem's (anywhere in its chain), or SQLite's SQLITE_FULL."""
    if isinstance(exc, sqlite3.OperationalError):
        code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+; 3.10 has the message only
        return code == _SQLITE_FULL if code is not None else "database or disk is full" in str(exc)
    return disk_full_cause(exc) is not None
