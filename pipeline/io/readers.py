"""Input sources: enumerate the input files of a location and stream their rows, never a whole file in memory.

    source = input_source("s3://bucket/batches/", storage)    # or a file, a directory, a glob, an http(s) URL
    for name, number, payload in source.rows(stats): ...      # payload: JSON line bytes, a dict, or BadRow

`InputSource` is what the job reads its input through; the parts live beside it:
- where the files are and how their bytes are reached, one store per kind of location (`INPUT_STORES`):
  io/local_input.py, io/s3_input.py, io/http_input.py, on io/input_store.py;
- one input file and its format: io/input_files.py; the rows of each format: io/jsonl.py, io/parquet.py;
  what reading yields (Row, BadRow, ReadStats): io/rows.py;
- the input cut into pieces for parallel reading (`plan_reads`, `piece_rows`): io/pieces.py;
- the fingerprint that resume compares: io/fingerprint.py.

Reading in pieces: the pieces come in input order with the byte ranges to scan first (`plan_reads`); `scan` counts a
range's newlines (and hashes it when the fingerprint is built from the bytes), `with_line_counts` gives each JSONL
range the count of lines ahead of it, and `piece_rows` reads a piece with its rows numbered as in the whole file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pipeline.config import InputLimits, StorageConfig
from pipeline.io.fingerprint import listing_fingerprint, scanned_fingerprint
from pipeline.io.http_input import HttpInput
from pipeline.io.input_files import InputFile, iter_rows, sniffed_format
from pipeline.io.input_store import InputStore
from pipeline.io.jsonl import align_to_line, is_gzip, iter_jsonl
from pipeline.io.local_input import LocalInput
from pipeline.io.locations import Location, RetryPolicy, parse_location
from pipeline.io.parquet import check_parquet_schema, open_parquet
from pipeline.io.pieces import (
    PIECE_ROWS,
    RANGE_BYTES,
    ByteRange,
    InputPiece,
    file_ranges,
    lead_rows,
    row_group_runs,
    sliced_runs,
)
from pipeline.io.rows import READ_CHUNK, ReadStats, Row, TableRead
from pipeline.io.s3_input import S3Input

# One entry per kind of location (Location.kind): how its input files are listed, read and fingerprinted.
INPUT_STORES: dict[str, type[InputStore]] = {"local": LocalInput, "s3": S3Input, "http": HttpInput}

# Fewer bytes than the shortest line that can hold a valid request (`{"custom_id":"a","method":"POST","url":"/score",
# "body":{}}` takes 59 with its newline): a file's size over this bounds the requests it can hold.
MIN_REQUEST_BYTES = 48


class InputSource:
    """The input files of one location, in a stable order, and the rows they hold."""

    def __init__(
        self,
        location: Location,
        files: list[InputFile],
        storage: StorageConfig | None = None,
        limits: InputLimits | None = None,
    ) -> None:
        self.files = files
        self.limits = limits or InputLimits()  # bounds on one line, enforced as rows are read
        self.table: TableRead | None = None  # a dataset job's input: read as a table (io/rows.TableRead)
        self.store = INPUT_STORES[location.kind](location, storage or StorageConfig())

    @property
    def location(self) -> Location:
        return self.store.location

    @property
    def storage(self) -> StorageConfig:
        return self.store.storage

    @property
    def policy(self) -> RetryPolicy:
        return self.store.policy

    @property
    def kind(self) -> str:
        return self.location.kind

    def describe(self) -> str:
        return self.store.describe()

    def __str__(self) -> str:
        return self.describe()

    @property
    def size_bytes(self) -> int | None:
        sizes = [f.size for f in self.files]
        return None if any(s is None for s in sizes) else sum(sizes)  # type: ignore[misc]

    def rows_at_most(self) -> int | None:
        """An upper bound on the rows, known before reading them (None: no bound without reading): a JSONL line of
        a request takes at least MIN_REQUEST_BYTES; a local Parquet file says its rows in its footer."""
        peek = self.store.peeks_cheaply
        total = 0
        for index, file in enumerate(self.files):
            if file.size is None:
                return None
            fmt = self.file_format(index) if peek else file.declared_format
            if fmt == "parquet" and peek:
                total += self._parquet_file(file).metadata.num_rows
            elif fmt == "jsonl" and not file.ref.split("?", 1)[0].endswith(".gz"):
                total += file.size // MIN_REQUEST_BYTES + 1
            else:
                return None  # compressed rows, or a format known only once read
        return total

    # -- pieces: the input cut into units of parallel reading -------------------------------------------------------
    def file_format(self, index: int) -> str:
        """The format of file `index`, "jsonl" or "parquet": from its name, else from the Parquet magic bytes
        (http: decided once downloaded)."""
        file = self.files[index]
        return file.declared_format or sniffed_format(self.store.head(file, 4))

    def file_formats(self) -> set[str]:
        """The formats of the input's files: {"jsonl"}, {"parquet"} or both."""
        return {self.file_format(index) for index in range(len(self.files))}

    def plan_reads(
        self, range_bytes: int = RANGE_BYTES, piece_rows: int = PIECE_ROWS, lead: Sequence[int] = ()
    ) -> tuple[list[InputPiece], list[ByteRange]]:
        """The pieces to read, in input order, and the byte ranges to scan first: every HASH_RANGE_BYTES range of a
        local file (its fingerprint), and the ranges of an S3 JSONL file split into `range_bytes` ranges (their
        newline counts number its lines; a local file's are counted in its hash ranges, cut where a range starts).
        Parquet files are cut into runs of whole row groups of about `piece_rows` rows (their byte sizes say little
        about the work: a column of repeated bodies costs a few bytes a row).
        A range piece's `before` is filled in from the scans (`with_line_counts`); the others' is known. `lead`: the
        sizes of the first file's first ranges (`file_ranges`), or for a Parquet file its first slices of rows
        (`lead_rows`): a streamed job's first requests reach the engines within a second of reading."""
        pieces: list[InputPiece] = []
        scans: list[ByteRange] = []
        if self.store.downloaded:
            return [InputPiece(0, 0, "http")], []
        for index, file in enumerate(self.files):
            size = file.size or 0
            fmt = self.file_format(index)
            ranges = file_ranges(size, range_bytes, lead if index == 0 else ())
            split = fmt == "jsonl" and len(ranges) > 1 and not is_gzip(file.ref)
            scans += self.store.scans(index, size, ranges if split else [])
            if fmt == "parquet":
                metadata = self._parquet_file(file).metadata
                runs = row_group_runs(metadata, piece_rows)
                slices = sliced_runs(runs, metadata.num_rows, lead_rows(lead) if index == 0 else ())
                for first, last, rows_before, skip, take in slices:
                    pieces.append(
                        InputPiece(len(pieces), index, "parquet", first, last, rows_before, skip, take)
                    )
            elif split:
                pieces += [
                    InputPiece(len(pieces) + i, index, "jsonl", a, b, -1) for i, (a, b) in enumerate(ranges)
                ]
            else:
                pieces.append(InputPiece(len(pieces), index, "jsonl"))
        return pieces, scans

    def _parquet_file(self, file: InputFile):
        return open_parquet(self.store.footer_handle(file), file.name)

    def scan(self, byte_range: ByteRange) -> tuple[list[int], str | None]:
        """(newlines in each segment of the range, its sha256 for a local file, else None), reading it once in
        bounded chunks."""
        file = self.files[byte_range.file]
        digest = hashlib.sha256() if self.store.fingerprints_bytes else None
        counts = []
        with self.store.open(file) as stream:
            stream.seek(byte_range.start)
            for start, end in byte_range.segments():
                newlines, left = 0, end - start
                while left > 0:
                    chunk = stream.read(min(READ_CHUNK, left))
                    if not chunk:
                        break
                    left -= len(chunk)
                    newlines += chunk.count(b"\n")
                    if digest is not None:
                        digest.update(chunk)
                counts.append(newlines)
        return counts, digest.hexdigest() if digest is not None else None

    def local_fingerprint(self, scans: list[ByteRange], digests: list[str]) -> str:
        """The fingerprint of a local input from the digests of its scanned ranges (every range of every file)."""
        names = [(self.store.fingerprint_name(file), file.size or 0) for file in self.files]
        return scanned_fingerprint(names, scans, digests)

    def piece_rows(self, piece: InputPiece, stats: ReadStats | None = None) -> Iterator[Row]:
        """The rows of one piece, numbered as in the whole file. An http piece sets `stats.fingerprint`."""
        stats = stats if stats is not None else ReadStats()
        file = self.files[piece.file]
        if piece.kind == "http":
            vouched = yield from self.store.file_rows(file, self.limits, stats, self.table)
            stats.fingerprint = self.store.read_fingerprint(self.files, stats, vouched)
            return
        if piece.kind == "parquet":
            groups = list(range(piece.start, piece.end or 0))
            first = piece.before + piece.skip + 1
            rows = (piece.skip, piece.take)
            with self.store.parquet_reading(file) as handle:
                yield from iter_rows(handle, file, "parquet", self.limits, groups, first, self.table, rows)
            return
        with self.store.open(file) as stream:
            if piece.end is None:  # the whole file: gzip, or small enough to be one piece
                yield from iter_rows(stream, file, "jsonl", self.limits, table=self.table)
                return
            if piece.before < 0:
                raise ValueError(f"piece {piece.index} of {file.name}: its lines were not counted first")
            start, passed = align_to_line(stream, piece.start)
            first = piece.before + passed + 1
            yield from iter_jsonl(stream, file.name, self.limits.max_line_bytes, first, start, piece.end)

    def table_columns(self) -> list[str] | None:
        """The columns of a table input, from the first Parquet file's footer or the first JSONL object (None: no
        row to tell from). A dataset job checks its templates against them before any work."""
        from pipeline import json_codec

        for index, file in enumerate(self.files):
            if self.file_format(index) == "parquet" and not self.store.downloaded:
                return list(self._parquet_file(file).schema_arrow.names)
            for _, _, payload in self.store.file_rows(file, self.limits, ReadStats(), self.table):
                if isinstance(payload, dict):
                    return list(payload)
                try:
                    first = json_codec.loads(payload) if isinstance(payload, bytes) else None
                except ValueError:
                    return None  # its error is the row's
                return list(first) if isinstance(first, dict) else None
        return None

    # -- rows -------------------------------------------------------------------------------------------------------
    def rows(self, stats: ReadStats | None = None) -> Iterator[Row]:
        """Every row of every file, in file order; `stats` gets the byte count and, at the end, the fingerprint."""
        stats = stats if stats is not None else ReadStats()
        vouched = None
        for file in self.files:
            stats.files += 1
            vouched = yield from self.store.file_rows(file, self.limits, stats, self.table)
        stats.fingerprint = self.store.read_fingerprint(self.files, stats, vouched)

    # -- fingerprint without reading rows (resume) -----------------------------------------------------------------
    def s3_fingerprint(self) -> str:
        return listing_fingerprint(self.files)

    def fingerprint(self) -> str:
        """The fingerprint as `rows()` would report it, from the current state of the input (for resume)."""
        return self.store.fingerprint(self.files)


def input_source(location: str | Path | Location, storage: StorageConfig | None = None) -> InputSource:
    """Resolve a location to its input files (checked to exist and be reachable). Raises LocationError."""
    loc = location if isinstance(location, Location) else parse_location(str(location))
    source = InputSource(loc, [], storage or StorageConfig())
    source.files = source.store.list_files()
    return source


def check_parquet_schemas(source: InputSource) -> None:
    """Read the footers of Parquet inputs (local, S3) so a file of the wrong shape fails before any work (a dataset
    job's table has a shape of its own: its renderer checks the columns)."""
    if source.table is not None:
        return
    for file in source.files:
        if file.declared_format != "parquet":
            continue
        handle: Any = source.store.footer_handle(file)
        if handle is not None:  # None: read once downloaded (http)
            check_parquet_schema(handle, file.name)
