"""An input cut into pieces, the units of parallel reading: a whole file, a byte range of a JSONL file, or a run of
row groups of a Parquet file.

An uncompressed JSONL file larger than `range_bytes` is split into byte ranges (`file_ranges`); a range owns every
line whose first byte lies in it (see io/jsonl.py), so each line is read exactly once. A range does not know how
many lines precede it: the ranges are scanned first (`ByteRange`; bytes.count over the bytes, far faster than
parsing them), and each piece is given the count before it is read (`with_line_counts`). Gzip files and http(s)
inputs are one piece each; Parquet files are split by row groups (`row_group_runs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

RANGE_BYTES = 64 << 20  # a larger JSONL file is read in byte ranges of at most this size
PIECE_ROWS = 100_000  # Parquet rows read together (whole row groups): a couple of seconds of validation


@dataclass(frozen=True)
class ByteRange:
    """Bytes [start, end) of input file number `file`, to scan; `cuts`: offsets inside it where a read range starts
    (its newlines are counted per segment between them)."""

    file: int
    start: int
    end: int
    cuts: tuple[int, ...] = ()

    def segments(self) -> list[tuple[int, int]]:
        bounds = [self.start, *self.cuts, self.end]
        return list(zip(bounds, bounds[1:], strict=False))


@dataclass(frozen=True)
class InputPiece:
    """One unit of parallel reading: a whole file, a byte range of a JSONL file, or row groups of a Parquet file.

    `index` orders the pieces as the input is ordered (it names what the piece stages). JSONL range: bytes
    [start, end), `before` the newlines ahead of `start` (-1 until counted). Parquet: row groups [start, end),
    `before` the rows ahead of them, and of their rows `skip` skipped and `take` taken (None: to their end): a
    streamed job's first pieces are slices of its first row groups. Whole file (`end` None): `before` 0."""

    index: int
    file: int  # index into InputSource.files
    kind: str  # "jsonl" | "parquet" | "http"
    start: int = 0
    end: int | None = None
    before: int = 0
    skip: int = 0
    take: int | None = None


def with_line_counts(
    pieces: list[InputPiece], scans: list[ByteRange], newlines: list[list[int]]
) -> list[InputPiece]:
    """The pieces, each JSONL range given the number of newlines ahead of it, from the newlines the scans counted
    in each of their segments (scans in file order, as `plan_reads` lists them)."""
    ahead: dict[tuple[int, int], int] = {}
    running: dict[int, int] = {}
    for byte_range, counts in zip(scans, newlines, strict=True):
        for (start, _), count in zip(byte_range.segments(), counts, strict=True):
            ahead[(byte_range.file, start)] = running.get(byte_range.file, 0)
            running[byte_range.file] = running.get(byte_range.file, 0) + count
    return [
        replace(p, before=ahead[(p.file, p.start)]) if p.kind == "jsonl" and p.end is not None else p
        for p in pieces
    ]


def file_ranges(size: int, range_bytes: int = RANGE_BYTES, lead: Sequence[int] = ()) -> list[tuple[int, int]]:
    """The byte ranges a file of `size` bytes is read and hashed in: [start, end), in order; one for a small file.
    `lead`: the sizes of the first ranges, before the `range_bytes` ones (a streamed job's first pieces are small,
    so the engines get requests within a second of reading)."""
    if size <= range_bytes and not lead:
        return [(0, size)]
    ranges: list[tuple[int, int]] = []
    start = 0
    for length in (*lead, *[range_bytes] * -(-size // range_bytes)):
        if start >= size:
            break
        ranges.append((start, min(start + length, size)))
        start = ranges[-1][1]
    return ranges


def lead_rows(lead_bytes: Sequence[int], row_bytes: int = 512) -> list[int]:
    """A streamed job's first Parquet slices, in rows, from its first JSONL ranges' sizes (`file_ranges`' `lead`): a
    Batch line is a few hundred bytes, so a 1 MiB range is about 2,000 rows."""
    return [max(1, size // row_bytes) for size in lead_bytes]


def sliced_runs(
    runs: list[tuple[int, int, int]], total_rows: int, lead: Sequence[int]
) -> list[tuple[int, int, int, int, int | None]]:
    """The row-group runs of a Parquet file (`row_group_runs`), the first ones cut into slices of the `lead` sizes
    (rows): (first group, end group, rows before the run, rows of the run skipped, rows taken or None for the rest).
    A run's rows are read in order, so its slices number their rows as the whole file does."""
    sizes = list(lead)
    out: list[tuple[int, int, int, int, int | None]] = []
    for position, (first, end, before) in enumerate(runs):
        rows = (runs[position + 1][2] if position + 1 < len(runs) else total_rows) - before
        skip = 0
        while sizes and rows - skip > sizes[0]:
            take = sizes.pop(0)
            out.append((first, end, before, skip, take))
            skip += take
        out.append((first, end, before, skip, None))
    return out


def row_group_runs(metadata, piece_rows: int) -> list[tuple[int, int, int]]:
    """(first row group, end row group, rows before) of each piece of a Parquet file (its `metadata`): consecutive
    row groups of at least `piece_rows` rows together (the last piece may have fewer)."""
    groups: list[tuple[int, int, int]] = []
    first, rows_before, rows = 0, 0, 0
    for group in range(metadata.num_row_groups):
        rows += metadata.row_group(group).num_rows
        if rows - rows_before >= piece_rows or group == metadata.num_row_groups - 1:
            groups.append((first, group + 1, rows_before))
            first, rows_before = group + 1, rows
    return groups or [(0, 0, 0)]
