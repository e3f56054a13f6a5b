"""The retention sweeper: files past their `expires_at` are deleted, and the bytes of deleted files freed.

What frees what:
- an upload: its file under `files/` — once no unfinished batch reads it (a deleted or expired input of a running
  batch keeps its bytes until that batch ends: a resumed job checks its input is unchanged);
- a batch's output or error file: that file's shards (or, for a batch cut short, its staged parts of that kind);
- a finished batch's folder (`batches/<id>/`: job log, manifest, what is left of its output) once every output
  file it made is deleted and freed — or, for a batch that made none, once its output lifetime has passed since it
  ended.

Every step is marked in the database after the bytes are gone, and each is idempotent: a server killed mid-sweep
redoes the rest at its next sweep, and nothing not deleted or expired is ever touched. A delete through the API
frees at once (`free_file`); the sweep runs every `retention.sweep_seconds` in its own thread.

A server killed mid-request leaves what no row points at: an upload's scratch part, an upload renamed into place
before its row was inserted, a batch folder made before its row. `clear_leftovers` removes them when the next
server opens the data dir, before it takes a request — the only time nothing of the kind is in flight — unless its
database is new (then no row could name anything, and the files are the operator's to judge)."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from pipeline.io.staging import StagingArea
from pipeline.server import outputs

if TYPE_CHECKING:
    import sqlite3

    from pipeline.server.runner import DataDir
    from pipeline.server.store import Store

log = structlog.get_logger(__name__)


@dataclass
class Leftovers:
    parts: int = 0  # scratch parts of uploads cut short
    uploads: int = 0  # files under files/ that no stored row names
    folders: int = 0  # batch folders of no batch, or of a purged one


@dataclass
class Swept:
    expired: int = 0  # files marked deleted because they expired
    freed: int = 0  # deleted files whose bytes were removed
    freed_bytes: int = 0
    purged: int = 0  # batch folders removed


def remove_output_kind(out_dir: Path, kind: str) -> None:
    """Remove one kind (results or errors) of a batch's output: its shards once committed, else its staged parts.
    The other kind stays readable: a committed one's shards are listed by the manifest, a staged one's parts by
    their own directory."""
    if outputs.committed(out_dir):
        for shard in outputs.shards(out_dir, kind):
            shard.unlink(missing_ok=True)
        return
    staging = StagingArea(out_dir)
    if staging.exists():
        for part in staging.parts(kind):
            Path(part).unlink(missing_ok=True)


class Sweeper:
    def __init__(self, store: Store, data: DataDir, interval: float) -> None:
        self.store = store
        self.data = data
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="retention-sweeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        # A first sweep at start: what a previous server marked deleted but did not free (killed mid-sweep).
        while True:
            try:
                swept = self.sweep()
                if swept.expired or swept.freed or swept.purged:
                    log.info("retention sweep", **swept.__dict__)
            except Exception:  # noqa: BLE001 - one failed sweep must not stop the next
                log.exception("retention sweep failed")
            if self._stop.wait(self.interval):
                return

    def sweep(self, now: int | None = None) -> Swept:
        """Expire, free, purge: one pass."""
        now = int(time.time()) if now is None else now
        swept = Swept(expired=len(self.store.expire_files(now)))
        for row in self.store.files_to_free():
            swept.freed_bytes += self._free(row)
            swept.freed += 1
        for batch_id in self.store.batches_to_purge(now):
            self._purge(batch_id)
            swept.purged += 1
        return swept

    def clear_leftovers(self) -> Leftovers:
        """Remove what a killed server left that nothing points at. Call it only while no request runs: an upload
        in flight has a scratch part and, for a moment, a file without its row, and a batch being created a
        folder without its row."""
        found = Leftovers()
        for part in _entries(self.data.scratch):
            _remove(part)
            found.parts += 1
        if self.store.found_version == 0:
            # A database created just now beside uploads or batch folders (a lost or moved state.sqlite): that no
            # row names them says nothing about them; they are the operator's to judge, not removed.
            if unnamed := len(_entries(self.data.files)) + len(_entries(self.data.batches)):
                log.warning(
                    "the data dir's database is new: its uploads and batch folders are not served",
                    entries=unnamed,
                )
        else:
            stored = {self.data.upload(file_id).name for file_id in self.store.stored_file_ids()}
            for path in _entries(self.data.files):
                if path.name not in stored:
                    _remove(path)
                    found.uploads += 1
            # A folder the rows say was purged is as much a leftover as one of no batch.
            unpurged = set(self.store.unpurged_batch_ids())
            for path in _entries(self.data.batches):
                if path.name not in unpurged:
                    _remove(path)
                    found.folders += 1
        if found != Leftovers():
            log.info("removed what a stopped server left", **found.__dict__)
        return found

    def free_file(self, file_id: str) -> bool:
        """A file just deleted through the API: its bytes go now, unless an unfinished batch reads it (then at the
        first sweep after that batch ends), and with it its batch's folder when nothing else of it is left."""
        row = self.store.file_to_free(file_id)
        if row is None:
            return False
        self._free(row)
        if row["batch_id"]:
            for batch_id in self.store.batches_to_purge(int(time.time()), row["batch_id"]):
                self._purge(batch_id)
        return True

    def _free(self, row: sqlite3.Row) -> int:
        if row["purpose"] == "batch_output":
            remove_output_kind(self.data.output(row["batch_id"]), row["kind"])
        else:
            self.data.upload(row["id"]).unlink(missing_ok=True)
        self.store.mark_freed(row["id"])  # after the bytes are gone: a crash between redoes the unlink
        return row["bytes"]

    def _purge(self, batch_id: str) -> None:
        shutil.rmtree(self.data.batch(batch_id), ignore_errors=True)
        self.store.mark_purged(batch_id)


def _entries(directory: Path) -> list[Path]:
    return list(directory.iterdir()) if directory.is_dir() else []


def _remove(path: Path) -> None:
    # A leftover that cannot go (a network filesystem's busy placeholder) must not keep the server from starting.
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("a leftover could not be removed", path=str(path), error=str(exc))
