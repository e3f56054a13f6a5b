"""Input fingerprints: what `nightshift resume` compares to know that the input has not changed since the job began.

- local: the sha256 of the bytes, built from ranges of a fixed size (`HASH_RANGE_BYTES`, whatever size the file
  is read in): the sha256 of each range, combined in order (a file of one range: the sha256 of its bytes), so
  ranges hashed in parallel and a file hashed in one stream agree. Several files: their names, sizes and digests,
  hashed together.
- s3: the listing (key, size, ETag of every object); no byte is read for it.
- http(s): ETag / Last-Modified (+ Content-Length) when the server sends them, else the sha256 of the bytes.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from typing import BinaryIO

from pipeline.io.input_files import InputFile
from pipeline.io.pieces import ByteRange, file_ranges
from pipeline.io.rows import READ_CHUNK

# The local fingerprint hashes files in ranges of this size (fixed, whatever the read ranges: resume compares it).
HASH_RANGE_BYTES = 64 << 20


def hash_ranges(size: int) -> list[tuple[int, int]]:
    """The ranges a local file of `size` bytes is hashed in."""
    return file_ranges(size, HASH_RANGE_BYTES)


def combine_ranges(digests: list[tuple[int, int, str]]) -> str:
    """A file's digest from the sha256 of each of its ranges (start, end, hex): the range's own digest when there is
    one range, so a small file's fingerprint is simply the sha256 of its bytes."""
    if len(digests) == 1:
        return digests[0][2]
    combined = hashlib.sha256()
    for start, end, digest in digests:
        combined.update(f"{start}\t{end}\t{digest}\n".encode())
    return combined.hexdigest()


def content_fingerprint(file_hashes: list[tuple[str, int, str]]) -> str:
    """The fingerprint of files hashed byte by byte, from their (name, size, digest)."""
    if len(file_hashes) == 1:
        return f"sha256:{file_hashes[0][2]}"
    digest = hashlib.sha256()
    for name, size, sha in file_hashes:
        digest.update(f"{name}\t{size}\t{sha}\n".encode())
    return f"sha256:{digest.hexdigest()}"


def scanned_fingerprint(files: Sequence[tuple[str, int]], scans: list[ByteRange], digests: list[str]) -> str:
    """The content fingerprint of `files` (name, size) from the digests of their scanned ranges (every hash range
    of every file)."""
    per_file: dict[int, list[tuple[int, int, str]]] = {}
    for byte_range, digest in zip(scans, digests, strict=True):
        per_file.setdefault(byte_range.file, []).append((byte_range.start, byte_range.end, digest))
    return content_fingerprint(
        [(name, size, combine_ranges(per_file[index])) for index, (name, size) in enumerate(files)]
    )


def listing_fingerprint(files: list[InputFile]) -> str:
    """The fingerprint of object-store files from their listing: key, size and ETag."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.ref}\t{file.size}\t{file.etag}\n".encode())
    return f"s3:{digest.hexdigest()}"


def header_fingerprint(headers: dict[str, str]) -> str | None:
    """The fingerprint an HTTP server vouches for (ETag / Last-Modified, with Content-Length); None if it sends
    neither."""
    etag = headers.get("ETag")
    modified = headers.get("Last-Modified")
    if not etag and not modified:
        return None
    digest = hashlib.sha256(f"{etag}\t{modified}\t{headers.get('Content-Length')}".encode()).hexdigest()
    return f"http:{digest}"


class _RangeHasher:
    """sha256 of each HASH_RANGE_BYTES range of a byte stream fed in order; `digest()` combines them
    (combine_ranges)."""

    def __init__(self) -> None:
        self.range_bytes = HASH_RANGE_BYTES
        self.size = 0
        self._hash = hashlib.sha256()
        self._start = 0
        self._done: list[tuple[int, int, str]] = []

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        while len(view):
            room = self._start + self.range_bytes - self.size
            # A new range starts only when a byte of it arrives: a file never ends in an empty range.
            if room == 0:
                self._done.append((self._start, self.size, self._hash.hexdigest()))
                self._hash, self._start = hashlib.sha256(), self.size
                continue
            take = view[:room]
            self._hash.update(take)
            self.size += len(take)
            view = view[len(take) :]

    def digest(self) -> str:
        return combine_ranges([*self._done, (self._start, self.size, self._hash.hexdigest())])


class HashingRaw(io.RawIOBase):
    """Passes reads through, hashing every byte (the local fingerprint costs no second pass)."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.hash = _RangeHasher()

    @property
    def size(self) -> int:
        return self.hash.size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        n = self._raw.readinto(buffer)
        if n:
            self.hash.update(memoryview(buffer)[:n])
        return n or 0

    def close(self) -> None:
        self._raw.close()
        super().close()


def file_digest(path: str) -> tuple[str, int]:
    """A local file's digest as the fingerprint takes it (combine_ranges), and its size."""
    hasher = _RangeHasher()
    with open(path, "rb") as fh:
        while chunk := fh.read(READ_CHUNK):
            hasher.update(chunk)
    return hasher.digest(), hasher.size


def sha256_stream(fh: BinaryIO) -> tuple[str, int]:
    """The plain sha256 of a stream's bytes from where it stands, and their count."""
    digest = hashlib.sha256()
    size = 0
    while chunk := fh.read(READ_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size
