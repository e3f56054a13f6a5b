"""JSONL input (OpenAI Batch lines, `.gz` decompressed on the fly): its lines as rows, read in bounded pieces so no
line is ever held whole past the length limit, and the line boundaries a byte range of a file starts at.

A byte range owns every line whose first byte lies in it: it starts after the first newline at or after
`start - 1` (`align_to_line`) and reads through the line that crosses its end, so each line is read exactly once.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterator
from typing import BinaryIO

from pipeline.io.rows import DEFAULT_MAX_LINE_BYTES, READ_CHUNK, Row, too_long

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")


def _skip_line(stream: BinaryIO) -> tuple[int, bool]:
    """Read past the rest of a line in bounded pieces: (bytes skipped, whether a newline ended it)."""
    skipped = 0
    while True:
        piece = stream.readline(READ_CHUNK)
        if not piece:
            return skipped, False
        skipped += len(piece)
        if piece.endswith(b"\n"):
            return skipped, True


def iter_jsonl(
    stream: BinaryIO,
    source: str,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    first_number: int = 1,
    start: int = 0,
    end: int | None = None,
) -> Iterator[Row]:
    """Every non-blank line as (source, 1-based line number, stripped bytes); a leading UTF-8 BOM is dropped.

    A line longer than `max_line_bytes` is never held whole: at most the limit is read, the rest is skipped in
    pieces, and the row is a BadRow (line_too_long). With `end`, the stream stands at byte `start` of its file, at
    the start of line `first_number`, and only lines that start before `end` are read (the last one whole)."""
    number = first_number - 1
    position = start
    while end is None or position < end:
        raw = stream.readline(max_line_bytes + 1)
        if not raw:
            return
        number += 1
        position += len(raw)
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            skipped, newline = _skip_line(stream)
            position += skipped
            yield Row(source, number, too_long("line", len(raw) + skipped - newline, max_line_bytes))
            continue
        stripped = raw.strip()
        if not stripped:
            continue
        if number == 1 and stripped.startswith(b"\xef\xbb\xbf"):
            stripped = stripped[3:].strip()
            if not stripped:
                continue
        yield Row(source, number, stripped)


def align_to_line(stream: BinaryIO, start: int) -> tuple[int, int]:
    """Move a seekable stream to the first line that starts at or after byte `start`: (that line's offset, the
    newlines passed on the way: 1 when `start` fell inside a line, else 0). The offset is the file's size when no
    line starts there (`start` fell inside the last line)."""
    if start == 0:
        stream.seek(0)
        return 0, 0
    stream.seek(start - 1)
    if stream.read(1) == b"\n":
        return start, 0
    skipped, newline = _skip_line(stream)
    return start + skipped, int(newline)


def is_gzip(name: str) -> bool:
    return name.split("?", 1)[0].lower().endswith(".gz")


class _Capped(io.RawIOBase):
    """A decompressing stream that raises InputFormatError once it has given more than `limit` bytes."""

    def __init__(self, inner: BinaryIO, name: str, limit: int) -> None:
        self.inner, self.name, self.limit, self.given = inner, name, limit, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # noqa: ANN001 - a writable buffer
        count = self.inner.readinto(buffer)  # type: ignore[attr-defined]
        self.given += count or 0
        if self.given > self.limit:
            from pipeline.io.rows import InputFormatError

            raise InputFormatError(
                f"{self.name} decompresses to more than {self.limit:,} bytes (limits.max_decompressed_bytes): "
                "refused as a compression bomb; raise the limit if the file is meant to be that large"
            )
        return count


def maybe_gunzip(stream: io.BufferedReader, name: str, max_bytes: int | None = None) -> BinaryIO:
    if is_gzip(name):
        inflated = gzip.GzipFile(fileobj=stream, mode="rb")
        if max_bytes is None:
            return inflated  # type: ignore[return-value]
        return io.BufferedReader(_Capped(inflated, name, max_bytes), 1 << 20)  # type: ignore[return-value]
    return stream
