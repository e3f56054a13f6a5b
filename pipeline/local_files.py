"""Local files at the bottom of the import graph (stdlib only, besides `cluster.home`): atomic writes, and this
machine's nightshift directory. Engines, io/ and the runtime all write through it.

`nightshift_home` is defined once, in cluster/home.py, and passed on here: cluster/auth.py needs it too (the head's
Ray token lives there), cluster/ knows no pipeline/, and pipeline/ may import cluster/; the engines, which know
nothing of cluster/, take it from this module. cluster/home.py imports nothing of the project, so this module stays
at the bottom (tests/unit/test_import_layers.py keeps both there)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cluster.home import nightshift_home

__all__ = ["atomic_write_bytes", "atomic_write_json", "exclusive_lock", "fsync_path", "nightshift_home"]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `path` so that readers see the old file or the whole new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) across processes of this machine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # "a" creates the file without truncating it under another process that holds it open.
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
