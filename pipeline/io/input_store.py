"""Where the input of one kind of location lives and how its bytes are reached: one subclass per kind (a local path,
`s3://`, `http(s)://`; the registry is io/readers.py's INPUT_STORES). A store lists the input files, opens them,
streams a whole file's rows while taking what its fingerprint needs, and says how the input is fingerprinted."""

from __future__ import annotations

import contextlib
import io
from abc import ABC, abstractmethod
from collections.abc import Generator
from typing import Any, ClassVar

from pipeline.config import InputLimits, StorageConfig
from pipeline.io.fingerprint import content_fingerprint
from pipeline.io.input_files import InputFile
from pipeline.io.locations import Location, RetryPolicy
from pipeline.io.pieces import ByteRange
from pipeline.io.rows import ReadStats, Row, TableRead


class InputStore(ABC):
    kind: ClassVar[str] = ""
    # Whether a file's format and a Parquet file's footer can be read up front at no network cost (a local disk):
    # then `InputSource.rows_at_most` reads them.
    peeks_cheaply: ClassVar[bool] = False
    # Whether the input's fingerprint is the hash of its bytes: then scanning a range hashes it too.
    fingerprints_bytes: ClassVar[bool] = False
    # Whether the input is read whole, through one download: then it is one piece (kind "http"), with nothing to scan.
    downloaded: ClassVar[bool] = False

    def __init__(self, location: Location, storage: StorageConfig) -> None:
        self.location = location
        self.storage = storage
        self.policy = RetryPolicy.from_config(storage)

    @abstractmethod
    def list_files(self) -> list[InputFile]:
        """The input files at the location, in a stable order, checked to exist and be reachable. Raises
        LocationError."""

    @abstractmethod
    def describe(self) -> str:
        """The location as shown to the user."""

    def head(self, file: InputFile, size: int) -> bytes:
        """The first `size` bytes of `file` (fewer when it is shorter; none when they are known only once read)."""
        return b""

    def open(self, file: InputFile) -> io.BufferedReader:
        """A seekable stream of `file`'s bytes."""
        raise NotImplementedError(f"{self.describe()}: its input is read whole, not opened for ranges")

    def parquet_reading(self, file: InputFile) -> contextlib.AbstractContextManager[Any]:
        """What pyarrow reads a Parquet `file`'s rows from, while the context lasts: a path or a seekable stream."""
        return self.open(file)

    def footer_handle(self, file: InputFile) -> Any | None:
        """What pyarrow reads a Parquet `file`'s footer from, in small reads; None when only a download reads it."""
        return None

    def scans(self, index: int, size: int, read_ranges: list[tuple[int, int]]) -> list[ByteRange]:
        """The ranges of file number `index` (`size` bytes) to scan before reading it, given the byte ranges it is
        read in (none: it is read whole)."""
        return []

    def fingerprint_name(self, file: InputFile) -> str:
        """The name `file` goes by in a content fingerprint."""
        return file.name

    @abstractmethod
    def file_rows(
        self, file: InputFile, limits: InputLimits, stats: ReadStats, table: TableRead | None = None
    ) -> Generator[Row, None, str | None]:
        """Every row of the whole `file`, in order; `stats` gets its byte count (and its digest when the fingerprint
        is built from the bytes). Returns the fingerprint the file's server vouches for, if any."""

    def read_fingerprint(self, files: list[InputFile], stats: ReadStats, vouched: str | None) -> str:
        """The fingerprint of the input once every file was streamed into `stats` (`vouched`: what `file_rows`
        returned for the last file)."""
        return content_fingerprint(stats.file_hashes)

    @abstractmethod
    def fingerprint(self, files: list[InputFile]) -> str:
        """The fingerprint as reading every row would report it, from the current state of the input (resume)."""
