"""http(s) input: one URL, probed first (HEAD, or a one-byte GET where HEAD is refused), read with one GET into a
temporary file (resuming with a Range request when the server allows, else restarting from byte 0), then streamed
from disk: simple and robust against mid-stream failures. It is one piece; its format is known once downloaded.
Fingerprint: ETag / Last-Modified (+ Content-Length) when the server sends them, else the sha256 of the bytes."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Generator
from typing import Any, BinaryIO

from pipeline.config import InputLimits, StorageConfig
from pipeline.io.fingerprint import content_fingerprint, header_fingerprint, sha256_stream
from pipeline.io.input_files import InputFile, iter_rows, sniffed_format
from pipeline.io.input_store import InputStore
from pipeline.io.locations import (
    HttpStatusError,
    LocationError,
    RetryPolicy,
    http_open,
    http_problem,
    is_transient,
    redact_url,
    with_retries,
)
from pipeline.io.rows import ReadStats, Row, TableRead


class DownloadTooLarge(LocationError):
    """An http(s):// input past storage.http_max_download_bytes or http_max_download_s: never retried."""


def download(url: str, storage: StorageConfig, policy: RetryPolicy, dest: BinaryIO) -> dict[str, str]:
    """GET `url` into `dest`; a broken transfer resumes with a Range request when the server allows it. Bounded in
    bytes and in time (storage.http_max_download_bytes, http_max_download_s): the file is held on local disk."""
    state: dict[str, Any] = {"headers": None}
    deadline = time.monotonic() + storage.http_max_download_s

    def bounded() -> None:
        if dest.tell() > storage.http_max_download_bytes:
            raise DownloadTooLarge(
                f"GET {redact_url(url)}: more than {storage.http_max_download_bytes:,} bytes "
                "(storage.http_max_download_bytes); raise it if the input is meant to be that large"
            )
        if time.monotonic() > deadline:
            raise DownloadTooLarge(
                f"GET {redact_url(url)}: still downloading after {storage.http_max_download_s:.0f} s "
                "(storage.http_max_download_s)"
            )

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
                bounded()
            expected = response.headers.get("Content-Length")
            if response.status == 200 and expected is not None and dest.tell() != int(expected):
                raise ConnectionError(f"GET {redact_url(url)}: got {dest.tell()} of {expected} bytes")

    with_retries(attempt, f"download {redact_url(url)}", policy)
    return state["headers"] or {}


class HttpInput(InputStore):
    kind = "http"
    downloaded = True

    def list_files(self) -> list[InputFile]:
        url, storage = self.location.url, self.storage

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
            headers = with_retries(probe, f"HEAD {redact_url(url)}", self.policy)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, HttpStatusError) or is_transient(exc):
                raise LocationError(http_problem(exc, url, "read input")) from exc
            raise
        length = headers.get("Content-Length")
        file = InputFile(
            redact_url(url),
            url,
            int(length) if length and length.isdigit() else None,
            headers.get("ETag"),
            headers.get("Last-Modified"),
        )
        return [file]

    def describe(self) -> str:
        return redact_url(self.location.url)

    def file_rows(
        self, file: InputFile, limits: InputLimits, stats: ReadStats, table: TableRead | None = None
    ) -> Generator[Row, None, str | None]:
        """Downloads `file` first; returns the fingerprint its headers vouch for (None if they vouch for none)."""
        with tempfile.TemporaryFile(prefix="nightshift-input-") as tmp:
            headers = download(file.ref, self.storage, self.policy, tmp)
            tmp.seek(0)
            digest, size = sha256_stream(tmp)
            tmp.seek(0)
            fmt = file.declared_format or sniffed_format(tmp.read(4))
            tmp.seek(0)
            yield from iter_rows(tmp, file, fmt, limits, table=table)
        stats.size_bytes += size
        stats.file_hashes.append((self.fingerprint_name(file), size, digest))
        return header_fingerprint(headers)

    def read_fingerprint(self, files: list[InputFile], stats: ReadStats, vouched: str | None) -> str:
        # The headers vouch for one file's bytes only.
        return (vouched if len(files) == 1 else None) or content_fingerprint(stats.file_hashes)

    def fingerprint(self, files: list[InputFile]) -> str:
        file = files[0]
        headers = {"ETag": file.etag, "Last-Modified": file.last_modified, "Content-Length": file.size}
        fingerprint = header_fingerprint({k: v for k, v in headers.items() if v is not None})  # type: ignore[misc]
        if fingerprint:
            return fingerprint
        with tempfile.TemporaryFile(prefix="nightshift-input-") as tmp:
            download(file.ref, self.storage, self.policy, tmp)
            tmp.seek(0)
            return f"sha256:{sha256_stream(tmp)[0]}"
