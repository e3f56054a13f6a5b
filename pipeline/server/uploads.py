"""POST /v1/files: a multipart body parsed as it streams in, never held whole.

The file part goes straight to a temporary file under the data dir, its bytes and lines counted on the way; the
upload stops the moment it passes the size limit. The client's filename is kept as a label only: where the bytes
live is decided by the server's own id, so nothing a request says reaches a filesystem path.

Everything else in the body is bounded too, so memory stays flat whatever a client sends: the number of parts,
each part's headers, the form fields' bytes together, and the body as a whole — the file's limit plus
FORM_OVERHEAD_BYTES, counted as it streams in, so a chunked body (which declares no Content-Length) is cut there
just as a declared one is refused up front."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from python_multipart.multipart import MultipartParseError, MultipartParser, parse_options_header

# Small form fields (purpose, expires_after[...]) are read into memory; nothing legitimate is longer than this.
MAX_FIELD_BYTES = 1024
MAX_FILENAME_CHARS = 255
# An upload is `file`, `purpose` and `expires_after[anchor|seconds]`: room to spare, and no more.
MAX_FORM_PARTS = 16
MAX_FORM_FIELDS_BYTES = 8 * 1024  # every field but the file, together
MAX_PART_HEADER_BYTES = 4 * 1024  # one part's header lines, together
# What a body may hold beyond the file's bytes: boundaries, part headers and fields (covers the limits above).
FORM_OVERHEAD_BYTES = 64 * 1024


class UploadError(Exception):
    """A refused upload: the HTTP status and OpenAI error fields to answer with."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass
class Upload:
    path: Path  # the temporary file holding the file part
    filename: str
    size: int
    lines: int
    fields: dict[str, str] = field(default_factory=dict)


def boundary_of(content_type: str | None) -> bytes:
    kind, params = parse_options_header(content_type or "")
    if kind != b"multipart/form-data" or not params.get(b"boundary"):
        raise UploadError(400, "the body must be multipart/form-data with a boundary", code="invalid_request")
    return params[b"boundary"]


def _label(filename: str) -> str:
    """The client's filename as a harmless label: its last path component, printable, bounded."""
    name = filename.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(c for c in name if c.isprintable())
    return name[:MAX_FILENAME_CHARS] or "upload.jsonl"


async def receive_upload(
    content_type: str | None, body: AsyncIterator[bytes], scratch: Path, max_bytes: int
) -> Upload:
    """Parse the multipart stream; the caller owns (and must remove or move) `Upload.path`."""
    boundary = boundary_of(content_type)
    scratch.mkdir(parents=True, exist_ok=True)
    tmp = scratch / f"upload-{secrets.token_hex(8)}.part"
    state = {
        "headers": {},
        "header_field": b"",
        "header_value": b"",
        "name": None,
        "filename": None,
        "ended": False,
    }
    fields: dict[str, str] = {}
    current: bytearray = bytearray()
    sink = None
    counted = {
        "size": 0,
        "newlines": 0,
        "last": b"\n",
        "file_parts": 0,
        "filename": "",
        "parts": 0,
        "header_bytes": 0,
        "field_bytes": 0,
    }

    def on_part_begin() -> None:
        counted["parts"] += 1
        counted["header_bytes"] = 0
        if counted["parts"] > MAX_FORM_PARTS:
            raise UploadError(
                400,
                f"the form has more than {MAX_FORM_PARTS} parts; an upload sends `file` and `purpose` "
                "(and `expires_after[...]`)",
                code="too_many_form_parts",
            )

    def count_header(length: int) -> None:
        counted["header_bytes"] += length
        if counted["header_bytes"] > MAX_PART_HEADER_BYTES:
            raise UploadError(
                400,
                f"a form part's headers are longer than {MAX_PART_HEADER_BYTES} bytes",
                code="invalid_request",
            )

    def on_header_field(data: bytes, start: int, end: int) -> None:
        count_header(end - start)
        state["header_field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        count_header(end - start)
        state["header_value"] += data[start:end]

    def on_header_end() -> None:
        state["headers"][state["header_field"].lower()] = state["header_value"]
        state["header_field"], state["header_value"] = b"", b""

    def on_headers_finished() -> None:
        nonlocal sink
        disposition, params = parse_options_header(state["headers"].get(b"content-disposition", b""))
        if disposition != b"form-data" or b"name" not in params:
            raise UploadError(400, "a multipart part lacks Content-Disposition: form-data; name=…")
        state["name"] = params[b"name"].decode("utf-8", "replace")
        if state["name"] == "file":
            counted["file_parts"] += 1
            if counted["file_parts"] > 1:
                raise UploadError(400, "only one `file` part is allowed", param="file")
            counted["filename"] = _label(params.get(b"filename", b"").decode("utf-8", "replace"))
            sink = open(tmp, "wb")  # noqa: SIM115 - closed in on_part_end or the finally below
        current.clear()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if state["name"] == "file":
            counted["size"] += len(chunk)
            if counted["size"] > max_bytes:
                raise UploadError(
                    413,
                    f"file is larger than this server's limit of {max_bytes} bytes",
                    param="file",
                    code="file_too_large",
                )
            counted["newlines"] += chunk.count(b"\n")
            if chunk:
                counted["last"] = chunk[-1:]
            sink.write(chunk)
        else:
            current.extend(chunk)
            counted["field_bytes"] += len(chunk)
            if len(current) > MAX_FIELD_BYTES:
                raise UploadError(400, f"form field {state['name']!r} is too long", param=state["name"])
            if counted["field_bytes"] > MAX_FORM_FIELDS_BYTES:
                raise UploadError(
                    400,
                    f"the form's fields besides `file` hold more than {MAX_FORM_FIELDS_BYTES} bytes",
                    code="form_too_large",
                )

    def on_part_end() -> None:
        nonlocal sink
        if state["name"] == "file":
            sink.close()
            sink = None
        else:
            fields[state["name"]] = current.decode("utf-8", "replace")
        state["headers"] = {}

    def on_end() -> None:
        state["ended"] = True

    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
            "on_end": on_end,
        },
    )
    max_body = max_bytes + FORM_OVERHEAD_BYTES
    received = 0
    try:
        async for chunk in body:
            received += len(chunk)
            if received > max_body:
                raise UploadError(
                    413,
                    f"the request body is larger than this server's limit of {max_body} bytes (a file of up to "
                    f"{max_bytes} bytes and its form)",
                    param="file",
                    code="file_too_large",
                )
            parser.write(chunk)
        parser.finalize()
        if not state["ended"]:
            raise UploadError(400, "the multipart body ended before its closing boundary")
        if counted["file_parts"] == 0:
            raise UploadError(400, "missing the `file` part", param="file")
    except MultipartParseError as exc:
        _remove(tmp)
        raise UploadError(400, f"malformed multipart body: {exc}") from None
    except BaseException:
        _remove(tmp)
        raise
    finally:
        if sink is not None:
            sink.close()
    lines = counted["newlines"] + (0 if counted["last"] == b"\n" else 1)
    return Upload(tmp, counted["filename"], counted["size"], lines, fields)


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
