"""A small real filesystem for the full-disk tests: a size-limited tmpfs that the test mounts (and unmounts), and a
filler file that leaves it exactly as much free space as the test wants, so a write fails with the kernel's own
ENOSPC — not a mock of one."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

MiB = 1024 * 1024
FILLER = ".filler"


@contextmanager
def small_filesystem(path: Path, size_bytes: int = 16 * MiB) -> Iterator[Path]:
    """A tmpfs of `size_bytes` at `path` (made private, as the server wants its data dir). Mounting needs root or
    CAP_SYS_ADMIN; without it the test is skipped and says so."""
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"a size-limited tmpfs cannot be mounted here (needs root): {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)


def free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def fill(path: Path, leave_bytes: int = 0) -> Path:
    """Take all but `leave_bytes` of the filesystem's free space (rounded to its blocks) with one file; deleting
    the file gives the space back."""
    filler = path / FILLER
    taken = filler.stat().st_size if filler.exists() else 0
    size = max(0, taken + free_bytes(path) - leave_bytes)
    with open(filler, "ab") as f:
        if size > taken:
            os.posix_fallocate(f.fileno(), 0, size)
    return filler


def make_room(path: Path) -> None:
    (path / FILLER).unlink(missing_ok=True)
