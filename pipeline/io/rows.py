"""What reading an input yields: its rows (a JSON line's bytes, a Parquet row's dict, or a BadRow the reader already
knows is bad), the errors of a file that cannot be read as rows, and the statistics of one read.

Row numbers are 1-based: the line number for JSONL (blank lines are skipped but counted, like an editor's), the
row index for Parquet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pipeline.config import InputLimits
from pipeline.io.locations import LocationError

READ_CHUNK = 8 << 20  # bytes per ranged S3 GET / local read buffer
DEFAULT_MAX_LINE_BYTES = InputLimits().max_line_bytes


class InputFormatError(LocationError):
    """An input file that cannot be read as JSONL or Parquet request rows."""


class BadRow(NamedTuple):
    """A row the reader already knows is bad (a line over the length limit, a Parquet `body` string that is not
    JSON): becomes an error record with `code` (an ErrorCode value)."""

    custom_id: Any
    message: str
    code: str = "invalid_json"


class Row(NamedTuple):
    source: str  # the file, as shown in error records
    number: int  # 1-based line (JSONL) or row (Parquet)
    payload: bytes | dict[str, Any] | BadRow


def too_long(what: str, size: int, max_bytes: int, custom_id: Any = None) -> BadRow:
    message = f"{what} is {size:,} bytes, longer than the limit of {max_bytes:,} (limits.max_line_bytes)"
    return BadRow(custom_id, message, "line_too_long")


@dataclass(frozen=True)
class TableRead:
    """An input read as an ordinary table (a dataset job): Parquet rows come as dicts of their columns' values (only
    `columns`, or all), JSONL lines as their bytes, for the job's renderer to make requests of; no request-line
    schema is asked of them."""

    columns: tuple[str, ...] | None = None
    # The columns a request is made of, given as Python values; the others read stay in Arrow (TableRow.batch) for
    # the output to keep as they are. None: every column read.
    rendered: tuple[str, ...] | None = None


class TableRow(dict):
    """A Parquet table's row: its `rendered` columns as Python values, and where it sits in the Arrow batch it was
    read from (`batch`, `index`), whose other columns reach the output without passing through Python."""

    __slots__ = ("batch", "index")


@dataclass
class ReadStats:
    """Filled in while `InputSource.rows` streams: bytes read and the input fingerprint (set at the end)."""

    size_bytes: int = 0
    fingerprint: str = ""
    files: int = 0
    file_hashes: list[tuple[str, int, str]] = field(default_factory=list)
