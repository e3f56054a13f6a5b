"""The data dir as the server keeps it: private to the server's user, held by one server at a time, and durable
before the database points into it.

- Private: every directory 0700 and every file 0600. The server process (and so its local Ray, its replica and
  the batches' job processes, which inherit it) runs with umask 077, so everything they create is born private —
  SQLite's database and its -wal/-shm, uploads, the jobs' checkpoints and shards (pyarrow and fsspec create files
  through the umask too). What a process with another umask wrote (a Ray worker of a cluster the server joined)
  is tightened after the fact: the whole dir when a server starts (data dirs of older servers included), a batch's
  folder when its job ends.
- One server: an exclusive flock on `server.lock`, taken where the database is opened (the Serve replica) and held
  for that process's lifetime. The kernel drops it when the process dies, however it dies, so a replica Serve
  restarts takes it back; the job processes do not inherit it (Python opens files non-inheritable), so an orphan
  cannot keep it. The holder writes its pid and host into the file, for the message that refuses the next one.
- Durable: a file the database is about to point at is fsynced, then renamed into place, then its directory is
  fsynced, so after a power cut a row never names a file that is missing or torn.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import structlog

from pipeline.config import ConfigError
from pipeline.local_files import fsync_path

log = structlog.get_logger(__name__)

PRIVATE_UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600
LOCK_NAME = "server.lock"
# How long `nightshift serve` waits for a lock before refusing: the processes of a server that was just killed
# (its replica among them) take a moment to end.
STARTUP_LOCK_WAIT_SECONDS = 15.0


class DataDirInUse(ConfigError):
    """Another server holds the data dir."""


# -- private ----------------------------------------------------------------------------------------------------------


def private_umask() -> None:
    """From now on this process and its children create files 0600 and directories 0700."""
    os.umask(PRIVATE_UMASK)


def make_private(root: Path) -> int:
    """Take group and other bits off `root` and everything under it (symlinks are left alone: they are not
    followed). Returns how many entries changed."""
    changed = 0
    for path in _walk(root):
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            continue  # removed meanwhile (a job's commit drops its `_staging/`)
        if stat.S_ISLNK(mode) or not stat.S_IMODE(mode) & 0o077:
            continue
        wanted = DIR_MODE if stat.S_ISDIR(mode) else stat.S_IMODE(mode) & 0o700
        with contextlib.suppress(FileNotFoundError):
            path.chmod(wanted)
            changed += 1
    return changed


def _walk(root: Path) -> Iterator[Path]:
    yield root
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            yield Path(parent) / name


def create_private(root: Path) -> None:
    """`root` and its missing parents as a private directory (an existing root is tightened, not its parents)."""
    root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    root.chmod(DIR_MODE)


# -- one server -------------------------------------------------------------------------------------------------------


class DataDirLock:
    """The exclusive lock of one data dir, held until `release` or the end of the process."""

    def __init__(self, root: Path, fd: int) -> None:
        self.root = root
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, root: Path, wait_seconds: float = 0.0) -> DataDirLock:
        """Take the lock, waiting up to `wait_seconds` for a holder to let go; DataDirInUse if it does not."""
        create_private(root)
        path = root / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        deadline = time.monotonic() + wait_seconds
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise DataDirInUse(in_use_message(root)) from None
                if not announced:
                    log.info("waiting for the data dir's lock", data_dir=str(root), holder=holder(root))
                    announced = True
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        return cls(root, fd)

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor of the open file drops its flock

    @property
    def held(self) -> bool:
        return self._fd is not None


def check_free(root: Path, wait_seconds: float | None = None) -> None:
    """Refuse (DataDirInUse) when another server holds `root`, before this one starts anything; by default after
    STARTUP_LOCK_WAIT_SECONDS."""
    DataDirLock.acquire(root, STARTUP_LOCK_WAIT_SECONDS if wait_seconds is None else wait_seconds).release()


def holder(root: Path) -> str | None:
    """ "pid N on host H" of the process that last took the lock, if it says."""
    try:
        pid, _, host = (root / LOCK_NAME).read_text().strip().partition(" ")
    except OSError:
        return None
    if not pid.isdigit():
        return None
    return f"pid {pid}" + (f" on host {host}" if host else "")


def in_use_message(root: Path) -> str:
    who = holder(root)
    return (
        f"data dir {root} is in use by another nightshift server ({who or 'pid unknown'}): one data dir serves one "
        "server — stop that one, or give this one its own --data-dir"
    )


# -- durable ----------------------------------------------------------------------------------------------------------


def publish(tmp: Path, dest: Path, data_synced: bool = False) -> None:
    """Move a finished temporary file into place durably: its data (unless the caller synced it already), then the
    rename, then the directory entry."""
    if not data_synced:
        fsync_path(tmp)
    os.replace(tmp, dest)
    fsync_path(dest.parent)


def fsync_tree(root: Path) -> None:
    """Every file under `root`, then every directory bottom-up (an entry is durable once its parent is synced)."""
    dirs: list[Path] = []
    for parent, _, files in os.walk(root):
        dirs.append(Path(parent))
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                fsync_path(Path(parent) / name)
    for directory in [*reversed(dirs), root.parent]:
        with contextlib.suppress(FileNotFoundError):
            fsync_path(directory)


def prepare_data_dir(root: Path) -> None:
    """`nightshift serve`, before Ray starts: umask 077 for the server process (its local Ray, replica and jobs
    inherit it), the data dir private, and no other server holding it."""
    private_umask()
    root = root.resolve()
    create_private(root)
    check_free(root)
