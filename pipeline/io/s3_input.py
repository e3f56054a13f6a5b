"""S3 input: an object, every input object under a prefix (hidden ones left out), or a glob over keys.

Listed once (key, size, ETag: the fingerprint, io/fingerprint.py). Objects are read in ranged GETs of a few MiB,
each retried on its own, so a failure mid-object resumes at the same byte offset — no row is read twice or skipped.
"""

from __future__ import annotations

import io
from collections.abc import Generator
from typing import Any

from pipeline.config import InputLimits
from pipeline.io.fingerprint import listing_fingerprint
from pipeline.io.input_files import INPUT_SUFFIXES, InputFile, is_hidden, iter_rows, sniffed_format
from pipeline.io.input_store import InputStore
from pipeline.io.locations import (
    LocationError,
    RetryPolicy,
    s3_error_code,
    s3_filesystem,
    s3_problem,
    with_retries,
)
from pipeline.io.pieces import ByteRange
from pipeline.io.rows import READ_CHUNK, ReadStats, Row, TableRead


class S3RangeReader(io.RawIOBase):
    """A seekable read-only view of one S3 object, fetched in ranged GETs, each retried on its own.

    A failure in the middle of an object costs one range, and reading continues at the same offset: rows are
    neither duplicated nor skipped. Memory: one chunk.
    """

    def __init__(self, fs, key: str, size: int, policy: RetryPolicy, chunk: int = READ_CHUNK) -> None:
        self._fs = fs
        self._key = key
        self._size = size
        self._policy = policy
        self._chunk = chunk
        self._pos = 0
        self._buf = b""
        self._buf_start = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:  # type: ignore[override]
        if self._pos >= self._size:
            return 0
        offset = self._pos - self._buf_start
        if not (0 <= offset < len(self._buf)):
            start, end = self._pos, min(self._size, self._pos + max(self._chunk, len(buffer)))
            self._buf = with_retries(
                lambda: self._fs.cat_file(self._key, start=start, end=end),
                f"read s3://{self._key} bytes {start}-{end}",
                self._policy,
            )
            if not self._buf:
                raise OSError(f"s3://{self._key}: empty read at offset {start} of {self._size}")
            self._buf_start = start
            offset = 0
        n = min(len(buffer), len(self._buf) - offset)
        memoryview(buffer)[:n] = self._buf[offset : offset + n]
        self._pos += n
        return n


class S3Input(InputStore):
    kind = "s3"
    _fs: Any = None

    def _s3(self):
        if self._fs is None:
            self._fs = s3_filesystem(self.storage)
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}  # read tasks build their own S3 client

    def list_files(self) -> list[InputFile]:
        location, fs = self.location, self._s3()
        url = location.url

        def entry(info: dict[str, Any]) -> InputFile:
            key = info["name"]
            etag = str(info.get("ETag") or info.get("etag") or "").strip('"') or None
            return InputFile(f"s3://{key}", key, int(info.get("size") or 0), etag)

        def listing() -> list[dict[str, Any]]:
            if location.has_glob():
                return list(fs.glob(location.path, detail=True).values())
            if location.key:
                try:
                    info = fs.info(location.path)
                    if info.get("type") == "file":
                        return [info]
                except FileNotFoundError as exc:
                    if s3_error_code(exc)[0] == "NoSuchBucket":
                        raise
            prefix = location.path.rstrip("/")
            found = fs.find(prefix, detail=True, withdirs=False)
            if not found:
                fs.ls(location.bucket)  # raises NoSuchBucket / AccessDenied when that is the reason
            return [
                info
                for key, info in found.items()
                if info.get("type") == "file"
                and key.lower().endswith(INPUT_SUFFIXES)
                and not any(is_hidden(part) for part in key[len(prefix) :].split("/") if part)
            ]

        try:
            infos = with_retries(listing, f"list {url}", self.policy)
        except Exception as exc:  # noqa: BLE001 - every S3 failure becomes a message that says what to change
            raise LocationError(s3_problem(exc, url, self.storage, "read input")) from exc
        files = sorted((entry(i) for i in infos), key=lambda f: f.ref)
        if not files:
            raise LocationError(
                f"input {url}: no input files (*.jsonl, *.parquet) at that key or under that prefix; check the path"
            )
        return files

    def describe(self) -> str:
        return self.location.url

    def head(self, file: InputFile, size: int) -> bytes:
        if not file.size:
            return b""
        fs = self._s3()
        return with_retries(
            lambda: fs.cat_file(file.ref, start=0, end=size), f"read s3://{file.ref}", self.policy
        )

    def open(self, file: InputFile) -> io.BufferedReader:
        return io.BufferedReader(S3RangeReader(self._s3(), file.ref, file.size or 0, self.policy), 1 << 20)

    def footer_handle(self, file: InputFile) -> io.BufferedReader:
        return io.BufferedReader(S3RangeReader(self._s3(), file.ref, file.size or 0, self.policy, 1 << 20))

    def scans(self, index: int, size: int, read_ranges: list[tuple[int, int]]) -> list[ByteRange]:
        """The read ranges themselves, when the file is read in ranges: their newline counts number its lines."""
        return [ByteRange(index, start, end) for start, end in read_ranges]

    def file_rows(
        self, file: InputFile, limits: InputLimits, stats: ReadStats, table: TableRead | None = None
    ) -> Generator[Row, None, str | None]:
        with self.open(file) as stream:
            fmt = file.declared_format or sniffed_format(stream.peek(4))
            yield from iter_rows(stream, file, fmt, limits, table=table)
        stats.size_bytes += file.size or 0
        return None

    def read_fingerprint(self, files: list[InputFile], stats: ReadStats, vouched: str | None) -> str:
        return listing_fingerprint(files)

    def fingerprint(self, files: list[InputFile]) -> str:
        return listing_fingerprint(files)
