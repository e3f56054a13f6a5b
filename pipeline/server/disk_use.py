"""What a key holds on the server's disk outside its files' rows, for its quotas (server/quotas.py): its uploads
still arriving, and its batches' folders beyond the output files registered from them — a running or paused batch's
checkpoint, a failed batch's staged rows and log — until the retention sweep purges the folder."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.server.store import Store


def tree_bytes(root: Path) -> int:
    """Bytes of the files under `root` (0 when it is gone); files vanishing meanwhile are skipped."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


class BatchFolders:
    """Bytes under an owner's unpurged batch folders that no file row counts already. An ended batch's folder no
    longer changes until it is purged: it is measured once, not at every upload."""

    def __init__(self, store: Store, folder_of) -> None:  # noqa: ANN001 - DataDir.batch
        self.store, self.folder_of = store, folder_of
        self._ended: dict[str, int] = {}

    def bytes_of(self, owner: str) -> int:
        total = 0
        for batch_id, registered, ended in self.store.unpurged_batches_of(owner):
            if ended and batch_id in self._ended:
                total += self._ended[batch_id]
                continue
            held = max(0, tree_bytes(self.folder_of(batch_id)) - registered)
            if ended:
                self._ended[batch_id] = held
            total += held
        return total


class UploadsInFlight:
    """Each key's uploads still arriving, capped per key, each counted at the size it declared (or the largest
    allowed, sent without a length) until it is kept or refused."""

    def __init__(self, per_key: int) -> None:
        self.per_key = per_key
        self._lock = threading.Lock()
        self._held: dict[str, list[int]] = {}

    @contextmanager
    def slot(self, owner: str, reserved: int) -> Iterator[None]:
        """Hold one of the owner's slots for an upload of `reserved` bytes; TooManyUploads when all are taken."""
        with self._lock:
            held = self._held.setdefault(owner, [])
            if len(held) >= self.per_key:
                raise TooManyUploads(self.per_key)
            held.append(reserved)
        try:
            yield
        finally:
            with self._lock:
                held.remove(reserved)
                if not held:
                    self._held.pop(owner, None)

    def reserved(self, owner: str) -> int:
        with self._lock:
            return sum(self._held.get(owner, []))


class TooManyUploads(Exception):
    def __init__(self, per_key: int) -> None:
        super().__init__(
            f"This key already sends {per_key} uploads at once (limits.max_concurrent_uploads_per_key); send "
            "this one when one of them has finished."
        )
