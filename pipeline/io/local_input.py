"""Local input: a file, a directory of shards (every *.jsonl / *.parquet under it, hidden ones left out), or a glob.
Streamed from disk; the fingerprint is the sha256 of the bytes, computed as they stream past (io/fingerprint.py)."""

from __future__ import annotations

import contextlib
import glob as globlib
import io
import os
from collections.abc import Generator
from pathlib import Path

from pipeline.config import InputLimits
from pipeline.io.fingerprint import HashingRaw, content_fingerprint, file_digest, hash_ranges
from pipeline.io.input_files import INPUT_SUFFIXES, InputFile, is_hidden, iter_rows, sniffed_format
from pipeline.io.input_store import InputStore
from pipeline.io.locations import LocationError
from pipeline.io.pieces import ByteRange
from pipeline.io.rows import READ_CHUNK, ReadStats, Row, TableRead


class LocalInput(InputStore):
    kind = "local"
    peeks_cheaply = True
    fingerprints_bytes = True

    def list_files(self) -> list[InputFile]:
        raw, path = self.location.raw, self.location.path
        if self.location.has_glob():
            matches = sorted(p for p in globlib.glob(path, recursive=True) if os.path.isfile(p))
            if not matches:
                raise LocationError(f"input {raw}: no files match the pattern; check the path")
            return [InputFile(p, p, os.path.getsize(p)) for p in matches]
        if not os.path.exists(path):
            raise LocationError(f"input {raw} does not exist: check the path")
        if os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not is_hidden(d))
                for name in names:
                    if not is_hidden(name) and name.lower().endswith(INPUT_SUFFIXES):
                        found.append(os.path.join(root, name))
            if not found:
                raise LocationError(
                    f"input {raw} is a directory: pass a JSONL file, or a directory holding *.jsonl / *.parquet "
                    "shards (none found)"
                )
            return [InputFile(p, p, os.path.getsize(p)) for p in sorted(found)]
        if not os.access(path, os.R_OK):
            raise LocationError(f"input {raw} is not readable: check its permissions")
        return [InputFile(path, path, os.path.getsize(path))]

    def describe(self) -> str:
        if self.location.has_glob():
            return self.location.path
        return str(Path(self.location.path).resolve())

    def head(self, file: InputFile, size: int) -> bytes:
        with open(file.ref, "rb") as fh:
            return fh.read(size)

    def open(self, file: InputFile) -> io.BufferedReader:
        return io.BufferedReader(io.FileIO(file.ref, "rb"), buffer_size=1 << 20)

    def parquet_reading(self, file: InputFile) -> contextlib.AbstractContextManager[str]:
        return contextlib.nullcontext(file.ref)

    def footer_handle(self, file: InputFile) -> str:
        return file.ref

    def scans(self, index: int, size: int, read_ranges: list[tuple[int, int]]) -> list[ByteRange]:
        """Every hash range of the file (its fingerprint), cut where a read range starts (the newlines before
        each read range are counted as the file is hashed)."""
        starts = [start for start, _ in read_ranges[1:]]
        return [
            ByteRange(index, first, last, tuple(c for c in starts if first < c < last))
            for first, last in hash_ranges(size)
        ]

    def fingerprint_name(self, file: InputFile) -> str:
        root = self.location.path
        return os.path.relpath(file.ref, root) if os.path.isdir(root) else file.ref

    def file_rows(
        self, file: InputFile, limits: InputLimits, stats: ReadStats, table: TableRead | None = None
    ) -> Generator[Row, None, str | None]:
        fmt = file.declared_format or sniffed_format(self.head(file, 4))
        if fmt == "parquet":
            yield from iter_rows(file.ref, file, fmt, limits, table=table)
            # Parquet reads jump around (footer first): the fingerprint hashes the file on its own.
            digest, size = file_digest(file.ref)
        else:
            hashing = HashingRaw(io.FileIO(file.ref, "rb"))
            with io.BufferedReader(hashing, buffer_size=1 << 20) as stream:
                yield from iter_rows(stream, file, fmt, limits, table=table)
                while stream.read(READ_CHUNK):  # bytes after the last line still belong to the fingerprint
                    pass
                digest, size = hashing.hash.digest(), hashing.size
        stats.size_bytes += size
        stats.file_hashes.append((self.fingerprint_name(file), size, digest))
        return None

    def fingerprint(self, files: list[InputFile]) -> str:
        hashes = []
        for file in files:
            digest, size = file_digest(file.ref)
            hashes.append((self.fingerprint_name(file), size, digest))
        return content_fingerprint(hashes)
