"""Local file primitives: atomic writes, streaming line reads with positions, fingerprints."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())


def iter_lines(path: Path, chunk_size: int = 1 << 20) -> Iterator[tuple[int, bytes]]:
    """Yield (1-based line number, line bytes without the newline) for every non-blank line.

    Streams the file; blank lines (including the usual trailing newline) are not requests and are skipped, but
    they still count toward the numbering so reported line numbers match an editor's.
    """
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, start=1):
            stripped = line.strip()
            if stripped:
                yield number, stripped


class Fingerprint:
    """sha256 + size of the input bytes, computed while streaming (resume refuses a changed input)."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.size = 0

    def update(self, data: bytes) -> None:
        self._hash.update(data)
        self.size += len(data)

    @property
    def value(self) -> str:
        return f"sha256:{self._hash.hexdigest()}"


def fingerprint_file(path: Path, chunk_size: int = 1 << 22) -> tuple[str, int]:
    fp = Fingerprint()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_size):
            fp.update(chunk)
    return fp.value, fp.size
