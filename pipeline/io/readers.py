"""Input sources: enumerate the input files of a location and stream their rows, never a whole file in memory.

    source = input_source("s3://bucket/batches/", storage)    # or a file, a directory, a glob, an http(s) URL
    for name, number, payload in source.rows(stats): ...      # payload: JSON line bytes, a dict, or BadRow

Formats: JSONL (OpenAI Batch lines; `.gz` decompressed on the fly) and Parquet (`custom_id`, `url`, `body` as a
JSON string or a struct, optional `method`). The format comes from the file name (`.parquet`/`.pq`/`.parq`), else
from the Parquet magic bytes, else JSONL.

How each kind is read:
- local: streamed from disk; the fingerprint is the sha256 of the bytes (computed as they stream past).
- s3: listed once (key, size, ETag: the fingerprint); objects are read in ranged GETs of a few MiB, each retried on
  its own, so a failure mid-object resumes at the same byte offset — no row is read twice or skipped.
- http(s): one GET, downloaded to a temporary file first (resuming with a Range request when the server allows,
  else restarting from byte 0), then streamed from disk; simple and robust against mid-stream failures.
  Fingerprint: ETag / Last-Modified (+ Content-Length) when the server sends them, else the sha256 of the bytes.

Row numbers are 1-based: the line number for JSONL (blank lines are skipped but counted, like an editor's), the
row index for Parquet.

Reading in pieces (`plan_reads`, `InputSource.piece_rows`): an uncompressed JSONL file larger than `range_bytes` is
split into byte ranges; a range owns every line whose first byte lies in it (it starts after the first newline at or
after `start - 1` and reads through the line that crosses its end), so each line is read exactly once. A range
does not know how many lines precede it: `InputSource.scan` counts them (bytes.count over the bytes, far faster than
parsing them), and the piece is given the count before it is read. Gzip files and http(s) inputs are one piece
each; Parquet files are split by row groups. The local fingerprint is built from ranges too, of a fixed size
(`HASH_RANGE_BYTES`, whatever size the file is read in): the sha256 of each range, combined in order (a file of one
range: the sha256 of its bytes), so ranges hashed in parallel and a file hashed in one stream agree.
"""

from __future__ import annotations

import glob as globlib
import gzip
import hashlib
import io
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import structlog

from pipeline import json_codec
from pipeline.config import InputLimits, StorageConfig
from pipeline.io.locations import (
    HttpStatusError,
    Location,
    LocationError,
    RetryPolicy,
    http_open,
    http_problem,
    is_transient,
    parse_location,
    redact_url,
    s3_filesystem,
    s3_problem,
    with_retries,
)

log = structlog.get_logger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")
PARQUET_SUFFIXES = (".parquet", ".pq", ".parq")
INPUT_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES
PARQUET_MAGIC = b"PAR1"
REQUIRED_PARQUET_COLUMNS = ("custom_id", "url", "body")
READ_CHUNK = 8 << 20  # bytes per ranged S3 GET / local read buffer
RANGE_BYTES = 64 << 20  # a larger JSONL file is read in byte ranges of at most this size
PIECE_ROWS = 100_000  # Parquet rows read together (whole row groups): a couple of seconds of validation
# The local fingerprint hashes files in ranges of this size (fixed, whatever the read ranges: resume compares it).
HASH_RANGE_BYTES = 64 << 20
# Fewer bytes than the shortest line that can hold a valid request (`{"custom_id":"a","method":"POST","url":"/score",
# "body":{}}` takes 59 with its newline): a file's size over this bounds the requests it can hold.
MIN_REQUEST_BYTES = 48


class InputFormatError(LocationError):
    """An input file that cannot be read as JSONL or Parquet request rows."""


class BadRow(NamedTuple):
    """A row the reader already knows is bad (a line over the length limit, a Parquet `body` string that is not
    JSON): becomes an error record with `code` (an ErrorCode value)."""

    custom_id: Any
    message: str
    code: str = "invalid_json"


DEFAULT_MAX_LINE_BYTES = InputLimits().max_line_bytes


class Row(NamedTuple):
    source: str  # the file, as shown in error records
    number: int  # 1-based line (JSONL) or row (Parquet)
    payload: bytes | dict[str, Any] | BadRow


@dataclass(frozen=True)
class InputFile:
    name: str  # shown as `source` in error records: the path or URL
    ref: str  # local path, s3 "bucket/key", or URL
    size: int | None = None
    etag: str | None = None
    last_modified: str | None = None

    @property
    def declared_format(self) -> str | None:
        lowered = self.ref.split("?", 1)[0].lower()
        if lowered.endswith(PARQUET_SUFFIXES):
            return "parquet"
        if lowered.endswith(JSONL_SUFFIXES):
            return "jsonl"
        return None


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
    `before` the rows ahead of them. Whole file (`end` None): `before` 0."""

    index: int
    file: int  # index into InputSource.files
    kind: str  # "jsonl" | "parquet" | "http"
    start: int = 0
    end: int | None = None
    before: int = 0


def with_line_counts(
    pieces: list[InputPiece], scans: list[ByteRange], newlines: list[list[int]]
) -> list[InputPiece]:
    """The pieces, each JSONL range given the number of newlines ahead of it, from the newlines the scans counted
    in each of their segments (scans in file order, as `plan_reads` lists them)."""
    from dataclasses import replace

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


@dataclass
class ReadStats:
    """Filled in while `InputSource.rows` streams: bytes read and the input fingerprint (set at the end)."""

    size_bytes: int = 0
    fingerprint: str = ""
    files: int = 0
    file_hashes: list[tuple[str, int, str]] = field(default_factory=list)


def _is_hidden(name: str) -> bool:
    return name.startswith((".", "_"))


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


def combine_ranges(digests: list[tuple[int, int, str]]) -> str:
    """A file's digest from the sha256 of each of its ranges (start, end, hex): the range's own digest when there is
    one range, so a small file's fingerprint is simply the sha256 of its bytes."""
    if len(digests) == 1:
        return digests[0][2]
    combined = hashlib.sha256()
    for start, end, digest in digests:
        combined.update(f"{start}\t{end}\t{digest}\n".encode())
    return combined.hexdigest()


def _combine_local(file_hashes: list[tuple[str, int, str]]) -> str:
    if len(file_hashes) == 1:
        return f"sha256:{file_hashes[0][2]}"
    digest = hashlib.sha256()
    for name, size, sha in file_hashes:
        digest.update(f"{name}\t{size}\t{sha}\n".encode())
    return f"sha256:{digest.hexdigest()}"


# -- byte streams -----------------------------------------------------------------------------------------------------


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


class _HashingRaw(io.RawIOBase):
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


def _download_http(url: str, storage: StorageConfig, policy: RetryPolicy, dest: BinaryIO) -> dict[str, str]:
    """GET `url` into `dest`; a broken transfer resumes with a Range request when the server allows it."""
    state: dict[str, Any] = {"headers": None}

    def attempt() -> None:
        headers: dict[str, str] = {}
        offset = dest.tell()
        validator = (state["headers"] or {}).get("ETag") or (state["headers"] or {}).get("Last-Modified")
        if offset and validator and (state["headers"] or {}).get("Accept-Ranges") == "bytes":
            headers = {"Range": f"bytes={offset}-", "If-Range": validator}
        elif offset:
            dest.seek(0)
            dest.truncate()
        with http_open("GET", url, storage, headers=headers) as response:
            if response.status != 206 and dest.tell():
                dest.seek(0)  # the server sent the whole body again
                dest.truncate()
            if state["headers"] is None or response.status == 200:
                state["headers"] = {k: v for k, v in response.headers.items()}
            while chunk := response.read(1 << 20):
                dest.write(chunk)
            expected = response.headers.get("Content-Length")
            if response.status == 200 and expected is not None and dest.tell() != int(expected):
                raise ConnectionError(f"GET {redact_url(url)}: got {dest.tell()} of {expected} bytes")

    with_retries(attempt, f"download {redact_url(url)}", policy)
    return state["headers"] or {}


def _http_fingerprint(headers: dict[str, str]) -> str | None:
    etag = headers.get("ETag")
    modified = headers.get("Last-Modified")
    if not etag and not modified:
        return None
    digest = hashlib.sha256(f"{etag}\t{modified}\t{headers.get('Content-Length')}".encode()).hexdigest()
    return f"http:{digest}"


# -- row decoding -----------------------------------------------------------------------------------------------------


def _too_long(what: str, size: int, max_bytes: int, custom_id: Any = None) -> BadRow:
    message = f"{what} is {size:,} bytes, longer than the limit of {max_bytes:,} (limits.max_line_bytes)"
    return BadRow(custom_id, message, "line_too_long")


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
            yield Row(source, number, _too_long("line", len(raw) + skipped - newline, max_line_bytes))
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


def _cleaner(arrow_type) -> Callable[[Any], Any] | None:
    """How to turn one Parquet value of `arrow_type` back into JSON-shaped Python: structs → dicts without the
    null fields a struct column invents for rows that lack them, maps → dicts. None when nothing needs doing."""
    import pyarrow as pa

    if pa.types.is_struct(arrow_type):
        fields = [
            (arrow_type.field(i).name, _cleaner(arrow_type.field(i).type))
            for i in range(arrow_type.num_fields)
        ]

        def clean_struct(value: Any) -> Any:
            if value is None:
                return None
            out = {}
            for name, sub in fields:
                item = value.get(name)
                if item is None:
                    continue
                out[name] = sub(item) if sub else item
            return out

        return clean_struct
    if pa.types.is_map(arrow_type):
        key_clean, item_clean = _cleaner(arrow_type.key_type), _cleaner(arrow_type.item_type)

        def clean_map(value: Any) -> Any:
            if value is None:
                return None
            return {
                (key_clean(k) if key_clean else k): (item_clean(v) if item_clean else v) for k, v in value
            }

        return clean_map
    if (
        pa.types.is_list(arrow_type)
        or pa.types.is_large_list(arrow_type)
        or pa.types.is_fixed_size_list(arrow_type)
    ):
        inner = _cleaner(arrow_type.value_type)
        if inner is None:
            return None
        return lambda value: None if value is None else [inner(v) for v in value]
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return lambda value: None if value is None else value.decode("utf-8", "replace")
    if pa.types.is_timestamp(arrow_type) or pa.types.is_date(arrow_type) or pa.types.is_decimal(arrow_type):
        return lambda value: None if value is None else str(value)
    return None


def parquet_schema_problem(schema, name: str) -> str | None:
    missing = [c for c in REQUIRED_PARQUET_COLUMNS if c not in schema.names]
    if missing:
        return (
            f"parquet input {name} has no column {', '.join(missing)} (it has: {', '.join(schema.names)}); "
            "expected custom_id, url, body (a JSON string or a struct) and optionally method"
        )
    return None


def iter_parquet(
    handle: Any,
    source: str,
    batch_rows: int = 8192,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_json_depth: int = json_codec.DEFAULT_MAX_DEPTH,
    row_groups: Sequence[int] | None = None,
    first_number: int = 1,
) -> Iterator[Row]:
    """Rows of a Parquet file (a path or a seekable file object), one row group batch at a time. A `body` string
    is held to the same limits as a JSONL line: `max_line_bytes`, and json_codec's nesting bound. `row_groups`:
    only those (consecutive) groups, the first of them starting at row `first_number`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(handle)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputFormatError(f"{source} is not a readable Parquet file: {exc}") from exc
    schema = pf.schema_arrow
    problem = parquet_schema_problem(schema, source)
    if problem:
        raise InputFormatError(problem)
    columns = [c for c in ("custom_id", "method", "url", "body") if c in schema.names]
    body_type = schema.field("body").type
    body_is_text = pa.types.is_string(body_type) or pa.types.is_large_string(body_type)
    body_is_binary = pa.types.is_binary(body_type) or pa.types.is_large_binary(body_type)
    clean_body = None if (body_is_text or body_is_binary) else _cleaner(body_type)
    clean = {c: _cleaner(schema.field(c).type) for c in columns if c != "body"}
    number = first_number - 1
    for batch in pf.iter_batches(batch_size=batch_rows, row_groups=row_groups, columns=columns):
        data = {}
        for name in columns:
            values = batch.column(name).to_pylist()
            fix = clean.get(name)
            data[name] = [fix(v) for v in values] if fix else values
        for i in range(batch.num_rows):
            number += 1
            row = {name: data[name][i] for name in columns}
            body = row.get("body")
            if body is not None:
                if body_is_text or body_is_binary:
                    if len(body) > max_line_bytes:
                        yield Row(
                            source, number, _too_long("body", len(body), max_line_bytes, row.get("custom_id"))
                        )
                        continue
                    try:
                        row["body"] = json_codec.loads(body, max_json_depth)
                    except (ValueError, UnicodeDecodeError) as exc:
                        yield Row(
                            source, number, BadRow(row.get("custom_id"), f"body is not valid JSON: {exc}")
                        )
                        continue
                elif clean_body is not None:
                    row["body"] = clean_body(body)
            if row.get("method") is None:
                row.pop("method", None)
            yield Row(source, number, row)


def _sniff_parquet(stream: io.BufferedReader) -> bool:
    return stream.peek(4)[:4] == PARQUET_MAGIC


# -- the source -------------------------------------------------------------------------------------------------------


class InputSource:
    """The input files of one location, in a stable order, and the rows they hold."""

    def __init__(
        self,
        location: Location,
        files: list[InputFile],
        storage: StorageConfig | None = None,
        limits: InputLimits | None = None,
    ) -> None:
        self.location = location
        self.files = files
        self.storage = storage or StorageConfig()
        self.limits = limits or InputLimits()  # bounds on one line, enforced as rows are read
        self.policy = RetryPolicy.from_config(self.storage)
        self._fs = None

    @property
    def _parquet_limits(self) -> dict[str, int]:
        return {"max_line_bytes": self.limits.max_line_bytes, "max_json_depth": self.limits.max_json_depth}

    @property
    def kind(self) -> str:
        return self.location.kind

    def describe(self) -> str:
        if self.kind == "local":
            return (
                str(Path(self.location.path).resolve())
                if not self.location.has_glob()
                else self.location.path
            )
        if self.kind == "http":
            return redact_url(self.location.url)
        return self.location.url

    def __str__(self) -> str:
        return self.describe()

    @property
    def size_bytes(self) -> int | None:
        sizes = [f.size for f in self.files]
        return None if any(s is None for s in sizes) else sum(sizes)  # type: ignore[misc]

    def rows_at_most(self) -> int | None:
        """An upper bound on the rows, known before reading them (None: no bound without reading): a JSONL line of
        a request takes at least MIN_REQUEST_BYTES; a local Parquet file says its rows in its footer."""
        total = 0
        for index, file in enumerate(self.files):
            if file.size is None:
                return None
            fmt = self.file_format(index) if self.kind == "local" else file.declared_format
            if fmt == "parquet" and self.kind == "local":
                total += self._parquet_file(file).metadata.num_rows
            elif fmt == "jsonl" and not file.ref.split("?", 1)[0].endswith(".gz"):
                total += file.size // MIN_REQUEST_BYTES + 1
            else:
                return None  # compressed rows, or a format known only once read
        return total

    def _s3(self):
        if self._fs is None:
            self._fs = s3_filesystem(self.storage)
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}  # read tasks build their own S3 client

    # -- pieces: the input cut into units of parallel reading -------------------------------------------------------
    def file_format(self, index: int) -> str:
        """The format of file `index`, "jsonl" or "parquet": from its name, else from the Parquet magic bytes
        (http: decided once downloaded)."""
        file = self.files[index]
        if file.declared_format or self.kind == "http":
            return file.declared_format or "jsonl"
        if self.kind == "local":
            with open(file.ref, "rb") as fh:
                head = fh.read(4)
        else:
            fs = self._s3()
            head = (
                with_retries(
                    lambda: fs.cat_file(file.ref, start=0, end=4), f"read s3://{file.ref}", self.policy
                )
                if file.size
                else b""
            )
        return "parquet" if head == PARQUET_MAGIC else "jsonl"

    def plan_reads(
        self, range_bytes: int = RANGE_BYTES, piece_rows: int = PIECE_ROWS, lead: Sequence[int] = ()
    ) -> tuple[list[InputPiece], list[ByteRange]]:
        """The pieces to read, in input order, and the byte ranges to scan first: every HASH_RANGE_BYTES range of a
        local file (its fingerprint), and the ranges of an S3 JSONL file split into `range_bytes` ranges (their
        newline counts number its lines; a local file's are counted in its hash ranges, cut where a range starts).
        Parquet files are cut into runs of whole row groups of about `piece_rows` rows (their byte sizes say little
        about the work: a column of repeated bodies costs a few bytes a row).
        A range piece's `before` is filled in from the scans (`with_line_counts`); the others' is known. `lead`: the
        sizes of the first JSONL file's first ranges (`file_ranges`)."""
        pieces: list[InputPiece] = []
        scans: list[ByteRange] = []
        if self.kind == "http":
            return [InputPiece(0, 0, "http")], []
        for index, file in enumerate(self.files):
            size = file.size or 0
            fmt = self.file_format(index)
            ranges = file_ranges(size, range_bytes, lead if index == 0 else ())
            split = fmt == "jsonl" and len(ranges) > 1 and not _is_gzip(file.ref)
            starts = [start for start, _ in ranges[1:]] if split else []
            if self.kind == "local":
                for first, last in file_ranges(size, HASH_RANGE_BYTES):
                    scans.append(ByteRange(index, first, last, tuple(c for c in starts if first < c < last)))
            elif split:
                scans += [ByteRange(index, start, end) for start, end in ranges]
            if fmt == "parquet":
                for first, last, rows_before in self._row_group_pieces(file, piece_rows):
                    pieces.append(InputPiece(len(pieces), index, "parquet", first, last, rows_before))
            elif split:
                pieces += [
                    InputPiece(len(pieces) + i, index, "jsonl", a, b, -1) for i, (a, b) in enumerate(ranges)
                ]
            else:
                pieces.append(InputPiece(len(pieces), index, "jsonl"))
        return pieces, scans

    def _row_group_pieces(self, file: InputFile, piece_rows: int) -> list[tuple[int, int, int]]:
        """(first row group, end row group, rows before) of each piece of a Parquet file: consecutive row groups of
        at least `piece_rows` rows together (the last piece may have fewer)."""
        meta = self._parquet_file(file).metadata
        groups: list[tuple[int, int, int]] = []
        first, rows_before, rows = 0, 0, 0
        for group in range(meta.num_row_groups):
            rows += meta.row_group(group).num_rows
            if rows - rows_before >= piece_rows or group == meta.num_row_groups - 1:
                groups.append((first, group + 1, rows_before))
                first, rows_before = group + 1, rows
        return groups or [(0, 0, 0)]

    def _parquet_file(self, file: InputFile):
        import pyarrow as pa
        import pyarrow.parquet as pq

        handle: Any = file.ref
        if self.kind == "s3":
            handle = io.BufferedReader(
                S3RangeReader(self._s3(), file.ref, file.size or 0, self.policy, 1 << 20)
            )
        try:
            return pq.ParquetFile(handle)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputFormatError(f"{file.name} is not a readable Parquet file: {exc}") from exc

    def _open(self, file: InputFile) -> io.BufferedReader:
        if self.kind == "local":
            return io.BufferedReader(io.FileIO(file.ref, "rb"), buffer_size=1 << 20)
        return io.BufferedReader(S3RangeReader(self._s3(), file.ref, file.size or 0, self.policy), 1 << 20)

    def scan(self, byte_range: ByteRange) -> tuple[list[int], str | None]:
        """(newlines in each segment of the range, its sha256 for a local file, else None), reading it once in
        bounded chunks."""
        file = self.files[byte_range.file]
        digest = hashlib.sha256() if self.kind == "local" else None
        counts = []
        with self._open(file) as stream:
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
        per_file: dict[int, list[tuple[int, int, str]]] = {}
        for byte_range, digest in zip(scans, digests, strict=True):
            per_file.setdefault(byte_range.file, []).append((byte_range.start, byte_range.end, digest))
        return _combine_local(
            [
                (self._relative(file), file.size or 0, combine_ranges(per_file[index]))
                for index, file in enumerate(self.files)
            ]
        )

    @staticmethod
    def _groups(piece: InputPiece) -> dict[str, Any]:
        return {"row_groups": list(range(piece.start, piece.end or 0)), "first_number": piece.before + 1}

    def piece_rows(self, piece: InputPiece, stats: ReadStats | None = None) -> Iterator[Row]:
        """The rows of one piece, numbered as in the whole file. An http piece sets `stats.fingerprint`."""
        stats = stats if stats is not None else ReadStats()
        file = self.files[piece.file]
        if piece.kind == "http":
            fingerprint = yield from self._http_rows(file, stats)
            stats.fingerprint = fingerprint or _combine_local(stats.file_hashes)
            return
        if piece.kind == "parquet":
            if self.kind == "local":
                yield from iter_parquet(file.ref, file.name, **self._parquet_limits, **self._groups(piece))
                return
            with self._open(file) as handle:
                yield from iter_parquet(handle, file.name, **self._parquet_limits, **self._groups(piece))
            return
        with self._open(file) as stream:
            if piece.end is None:  # the whole file: gzip, or small enough to be one piece
                yield from iter_jsonl(_maybe_gunzip(stream, file.ref), file.name, self.limits.max_line_bytes)
                return
            if piece.before < 0:
                raise ValueError(f"piece {piece.index} of {file.name}: its lines were not counted first")
            start, passed = align_to_line(stream, piece.start)
            first = piece.before + passed + 1
            yield from iter_jsonl(stream, file.name, self.limits.max_line_bytes, first, start, piece.end)

    # -- rows -------------------------------------------------------------------------------------------------------
    def rows(self, stats: ReadStats | None = None) -> Iterator[Row]:
        """Every row of every file, in file order; `stats` gets the byte count and, at the end, the fingerprint."""
        stats = stats if stats is not None else ReadStats()
        http_fingerprint = None
        for file in self.files:
            stats.files += 1
            if self.kind == "local":
                yield from self._local_rows(file, stats)
            elif self.kind == "s3":
                yield from self._s3_rows(file, stats)
            else:
                http_fingerprint = yield from self._http_rows(file, stats)
        if self.kind == "local":
            stats.fingerprint = _combine_local(stats.file_hashes)
        elif self.kind == "s3":
            stats.fingerprint = self.s3_fingerprint()
        else:
            stats.fingerprint = http_fingerprint or _combine_local(stats.file_hashes)

    def _local_rows(self, file: InputFile, stats: ReadStats) -> Iterator[Row]:
        fmt = file.declared_format
        if fmt is None:
            with open(file.ref, "rb") as fh:
                fmt = "parquet" if fh.read(4) == PARQUET_MAGIC else "jsonl"
        if fmt == "parquet":
            yield from iter_parquet(file.ref, file.name, **self._parquet_limits)
            # Parquet reads jump around (footer first): the fingerprint hashes the file on its own.
            digest, size = _file_digest(file.ref)
        else:
            hashing = _HashingRaw(io.FileIO(file.ref, "rb"))
            with io.BufferedReader(hashing, buffer_size=1 << 20) as stream:
                yield from iter_jsonl(_maybe_gunzip(stream, file.ref), file.name, self.limits.max_line_bytes)
                while stream.read(READ_CHUNK):  # bytes after the last line still belong to the fingerprint
                    pass
                digest, size = hashing.hash.digest(), hashing.size
        stats.size_bytes += size
        stats.file_hashes.append((self._relative(file), size, digest))

    def _s3_rows(self, file: InputFile, stats: ReadStats) -> Iterator[Row]:
        raw = S3RangeReader(self._s3(), file.ref, file.size or 0, self.policy)
        with io.BufferedReader(raw, buffer_size=1 << 20) as stream:
            fmt = file.declared_format or ("parquet" if _sniff_parquet(stream) else "jsonl")
            if fmt == "parquet":
                yield from iter_parquet(stream, file.name, **self._parquet_limits)
            else:
                yield from iter_jsonl(_maybe_gunzip(stream, file.ref), file.name, self.limits.max_line_bytes)
        stats.size_bytes += file.size or 0

    def _http_rows(self, file: InputFile, stats: ReadStats):
        with tempfile.TemporaryFile(prefix="nightshift-input-") as tmp:
            headers = _download_http(file.ref, self.storage, self.policy, tmp)
            tmp.seek(0)
            digest, size = _sha256_stream(tmp)
            tmp.seek(0)
            fmt = file.declared_format or ("parquet" if tmp.read(4) == PARQUET_MAGIC else "jsonl")
            tmp.seek(0)
            if fmt == "parquet":
                yield from iter_parquet(tmp, file.name, **self._parquet_limits)
            else:
                yield from iter_jsonl(_maybe_gunzip(tmp, file.ref), file.name, self.limits.max_line_bytes)  # type: ignore[arg-type]
        stats.size_bytes += size
        stats.file_hashes.append((file.name, size, digest))
        return _http_fingerprint(headers) if len(self.files) == 1 else None

    def _relative(self, file: InputFile) -> str:
        root = self.location.path
        return os.path.relpath(file.ref, root) if os.path.isdir(root) else file.ref

    # -- fingerprint without reading rows (resume) -----------------------------------------------------------------
    def s3_fingerprint(self) -> str:
        digest = hashlib.sha256()
        for file in self.files:
            digest.update(f"{file.ref}\t{file.size}\t{file.etag}\n".encode())
        return f"s3:{digest.hexdigest()}"

    def fingerprint(self) -> str:
        """The fingerprint as `rows()` would report it, from the current state of the input (for resume)."""
        if self.kind == "s3":
            return self.s3_fingerprint()
        if self.kind == "local":
            hashes = []
            for file in self.files:
                digest, size = _file_digest(file.ref)
                hashes.append((self._relative(file), size, digest))
            return _combine_local(hashes)
        file = self.files[0]
        headers = {"ETag": file.etag, "Last-Modified": file.last_modified, "Content-Length": file.size}
        fingerprint = _http_fingerprint({k: v for k, v in headers.items() if v is not None})  # type: ignore[misc]
        if fingerprint:
            return fingerprint
        with tempfile.TemporaryFile(prefix="nightshift-input-") as tmp:
            _download_http(file.ref, self.storage, self.policy, tmp)
            tmp.seek(0)
            return f"sha256:{_sha256_stream(tmp)[0]}"


def _is_gzip(name: str) -> bool:
    return name.split("?", 1)[0].lower().endswith(".gz")


def _maybe_gunzip(stream: io.BufferedReader, name: str) -> BinaryIO:
    if _is_gzip(name):
        return gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[return-value]
    return stream


def _sha256_stream(fh: BinaryIO) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    while chunk := fh.read(READ_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def _file_digest(path: str) -> tuple[str, int]:
    """A local file's digest as the fingerprint takes it (combine_ranges), and its size."""
    hasher = _RangeHasher()
    with open(path, "rb") as fh:
        while chunk := fh.read(READ_CHUNK):
            hasher.update(chunk)
    return hasher.digest(), hasher.size


# -- enumeration ------------------------------------------------------------------------------------------------------


def _local_files(location: Location) -> list[InputFile]:
    raw, path = location.raw, location.path
    if location.has_glob():
        matches = sorted(p for p in globlib.glob(path, recursive=True) if os.path.isfile(p))
        if not matches:
            raise LocationError(f"input {raw}: no files match the pattern; check the path")
        return [InputFile(p, p, os.path.getsize(p)) for p in matches]
    if not os.path.exists(path):
        raise LocationError(f"input {raw} does not exist: check the path")
    if os.path.isdir(path):
        found = []
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not _is_hidden(d))
            for name in names:
                if not _is_hidden(name) and name.lower().endswith(INPUT_SUFFIXES):
                    found.append(os.path.join(root, name))
        if not found:
            raise LocationError(
                f"input {raw} is a directory: pass a JSONL file, or a directory holding *.jsonl / *.parquet shards "
                "(none found)"
            )
        return [InputFile(p, p, os.path.getsize(p)) for p in sorted(found)]
    if not os.access(path, os.R_OK):
        raise LocationError(f"input {raw} is not readable: check its permissions")
    return [InputFile(path, path, os.path.getsize(path))]


def _s3_files(location: Location, storage: StorageConfig, fs, policy: RetryPolicy) -> list[InputFile]:
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
                from pipeline.io.locations import s3_error_code

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
            and not any(_is_hidden(part) for part in key[len(prefix) :].split("/") if part)
        ]

    try:
        infos = with_retries(listing, f"list {url}", policy)
    except Exception as exc:  # noqa: BLE001 - every S3 failure becomes a message that says what to change
        raise LocationError(s3_problem(exc, url, storage, "read input")) from exc
    files = sorted((entry(i) for i in infos), key=lambda f: f.ref)
    if not files:
        raise LocationError(
            f"input {url}: no input files (*.jsonl, *.parquet) at that key or under that prefix; check the path"
        )
    return files


def _http_file(location: Location, storage: StorageConfig, policy: RetryPolicy) -> InputFile:
    url = location.url

    def probe() -> dict[str, str]:
        try:
            with http_open("HEAD", url, storage) as response:
                return dict(response.headers.items())
        except HttpStatusError as exc:
            if exc.status not in (405, 501, 403):  # some servers (and presigned GET URLs) refuse HEAD
                raise
        with http_open("GET", url, storage, headers={"Range": "bytes=0-0"}) as response:
            headers = dict(response.headers.items())
            if response.status == 206:
                total = headers.get("Content-Range", "").rsplit("/", 1)[-1]
                headers["Content-Length"] = total if total.isdigit() else ""
            return headers

    try:
        headers = with_retries(probe, f"HEAD {redact_url(url)}", policy)
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, HttpStatusError) or is_transient(exc):
            raise LocationError(http_problem(exc, url, "read input")) from exc
        raise
    length = headers.get("Content-Length")
    return InputFile(
        redact_url(url),
        url,
        int(length) if length and length.isdigit() else None,
        headers.get("ETag"),
        headers.get("Last-Modified"),
    )


def input_source(location: str | Path | Location, storage: StorageConfig | None = None) -> InputSource:
    """Resolve a location to its input files (checked to exist and be reachable). Raises LocationError."""
    storage = storage or StorageConfig()
    loc = location if isinstance(location, Location) else parse_location(str(location))
    policy = RetryPolicy.from_config(storage)
    if loc.kind == "local":
        return InputSource(loc, _local_files(loc), storage)
    if loc.kind == "s3":
        source = InputSource(loc, [], storage)
        source.files = _s3_files(loc, storage, source._s3(), policy)
        return source
    return InputSource(loc, [_http_file(loc, storage, policy)], storage)


def check_parquet_schemas(source: InputSource) -> None:
    """Read the footers of Parquet inputs (local, S3) so a file of the wrong shape fails before any work."""
    import pyarrow.parquet as pq

    for file in source.files:
        if file.declared_format != "parquet" or source.kind == "http":
            continue
        if source.kind == "local":
            handle: Any = file.ref
        else:
            handle = io.BufferedReader(
                S3RangeReader(source._s3(), file.ref, file.size or 0, source.policy, 1 << 20)
            )
        try:
            schema = pq.read_schema(handle)
        except Exception as exc:  # noqa: BLE001
            raise InputFormatError(f"{file.name} is not a readable Parquet file: {exc}") from exc
        problem = parquet_schema_problem(schema, file.name)
        if problem:
            raise InputFormatError(problem)
