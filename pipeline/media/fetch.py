"""Media fetched as the policy allows (media/policy.py): every hop of a redirect checked, the connection made to the
address that was checked, at most `max_bytes` read, within `fetch_timeout_s` in all.

    media = fetch_media("https://images.example.com/cat.png", policy)   # Media(data, content_type)
    # MediaRefused: the policy forbids the URL or a redirect's target; nothing was fetched from it
    # MediaFetchFailed: the server could not be reached, answered an error, sent too much or too slowly

Either is the row's error, never the job's. Runs in the process that runs the row (the engine's), with urllib3's
connection: one pinned to the checked address (TLS still verifies the host's own name) is what it offers and the
standard library does not. A socket timeout bounds each read, not a server that sends a byte at a time, so a watchdog
shuts the connection at the deadline, whatever it is waiting for.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urljoin, urlsplit

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection

from pipeline.media.policy import MediaFetchFailed, MediaPolicy, MediaRefused, Resolver, Vetted

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 1 << 16


@dataclass(frozen=True)
class Media:
    data: bytes
    content_type: str | None


def fetch_media(url: str, policy: MediaPolicy, resolve: Resolver | None = None) -> Media:
    """The bytes of an http(s):// or (under allowed_local_media_path) file:// media URL."""
    if _scheme(url) == "file":
        return _read_local(url, policy)
    deadline = time.monotonic() + policy.fetch_timeout_s
    for _ in range(policy.max_redirects + 1):
        vetted = policy.vet(url, resolve)
        with _Exchange(vetted, deadline) as exchange:
            response = exchange.response
            if response.status in _REDIRECTS:
                url = _redirect_target(url, response, vetted)
                continue
            if response.status >= 400:
                raise MediaFetchFailed(f"{vetted.host} answered {response.status} for the media URL")
            return Media(exchange.read_capped(policy.max_bytes), response.headers.get("Content-Type"))
    raise MediaFetchFailed(f"more than {policy.max_redirects} redirects (media.max_redirects)")


def _scheme(url: str) -> str:
    try:
        return urlsplit(url).scheme.lower()
    except ValueError as exc:  # "Invalid IPv6 URL" and the like
        raise MediaRefused(f"the media URL cannot be read: {exc}") from None


def _redirect_target(url: str, response: urllib3.BaseHTTPResponse, vetted: Vetted) -> str:
    location = response.headers.get("Location")
    if not location:
        raise MediaFetchFailed(f"{vetted.host} answered {response.status} with no Location")
    try:
        target = urljoin(url, location)
    except ValueError as exc:
        raise MediaRefused(f"a redirect to a URL that cannot be read: {exc}") from None
    scheme = _scheme(target)
    if scheme not in ("http", "https"):  # never to file://, data:, gopher://...
        raise MediaRefused(f"a redirect to a {scheme}: URL (redirects are followed to http(s) only)")
    return target


class _Exchange:
    """One GET to a vetted address, with its watchdog: the connection is shut at the deadline."""

    def __init__(self, vetted: Vetted, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise MediaFetchFailed(_too_slow(vetted))
        self.vetted = vetted
        self.expired = threading.Event()
        if vetted.scheme == "https":
            self.connection: HTTPConnection = HTTPSConnection(
                vetted.address,
                vetted.port,
                timeout=left,
                server_hostname=vetted.host,  # SNI and the certificate's name are the host's, not the address's
                assert_hostname=vetted.host,
                cert_reqs="CERT_REQUIRED",
            )
        else:
            self.connection = HTTPConnection(vetted.address, vetted.port, timeout=left)
        self.sock: socket.socket | None = None
        self.watchdog = threading.Timer(left, self._expire)
        self.watchdog.daemon = True

    def _expire(self) -> None:
        self.expired.set()
        sock = self.sock or getattr(self.connection, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # a read blocked on it returns at once

    def __enter__(self) -> _Exchange:
        vetted = self.vetted
        default_port = 443 if vetted.scheme == "https" else 80
        host = f"[{vetted.host}]" if ":" in vetted.host else vetted.host
        headers = {
            "Host": host if vetted.port == default_port else f"{host}:{vetted.port}",
            "User-Agent": "nightshift-media-fetch",
            "Accept-Encoding": "identity",  # max_bytes counts what is stored, not what a compressor makes of it
        }
        self.watchdog.start()
        try:
            self.connection.connect()
            # Held here: a response without a length takes the socket over and the connection forgets it.
            self.sock = self.connection.sock
            if self.expired.is_set():
                raise MediaFetchFailed(_too_slow(vetted))
            self.connection.request("GET", vetted.target, headers=headers, preload_content=False)
            self.response = self.connection.getresponse()
        except BaseException as exc:
            self._close()
            raise self._failure(exc) from None
        return self

    def __exit__(self, kind, exc, traceback) -> None:
        self._close()
        if exc is not None:
            failure = self._failure(exc)
            if failure is not exc:
                raise failure from None

    def _close(self) -> None:
        self.watchdog.cancel()
        self.connection.close()

    def _failure(self, exc: BaseException) -> BaseException:
        """What a fetch's exception means for the row: too slow, unreachable, or (ours already) itself."""
        if isinstance(exc, MediaRefused | MediaFetchFailed):
            return exc
        timed_out = isinstance(exc, urllib3.exceptions.TimeoutError | TimeoutError) and not isinstance(
            exc,
            urllib3.exceptions.NewConnectionError,  # urllib3 derives "refused" from its timeout class
        )
        if self.expired.is_set() or timed_out:
            return MediaFetchFailed(_too_slow(self.vetted))
        if isinstance(exc, urllib3.exceptions.HTTPError | OSError | ValueError):
            reason = getattr(exc, "reason", None) or exc
            return MediaFetchFailed(f"could not fetch media from {self.vetted.host}: {reason}")
        return exc

    def read_capped(self, max_bytes: int) -> bytes:
        """The body, or MediaFetchFailed past `max_bytes` (told by Content-Length, else counted as it comes)."""
        response = self.response
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise MediaFetchFailed(_too_large(self.vetted, max_bytes))
        chunks, total = [], 0
        while True:
            chunk = response.read(_CHUNK, decode_content=False)
            if self.expired.is_set():  # the watchdog's shutdown reads as an end: the body is not whole
                raise MediaFetchFailed(_too_slow(self.vetted))
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if total > max_bytes:
                raise MediaFetchFailed(_too_large(self.vetted, max_bytes))
            chunks.append(chunk)


def read_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a `data:` URL (base64, or percent-encoded without `;base64`), at most `max_bytes`. A URL that
    is not one is a ValueError (the row's invalid request); one that holds too much is MediaFetchFailed."""
    header, comma, payload = url.partition(",")
    if not comma or header[:5].lower() != "data:":
        raise ValueError("a data: URL must read data:[<media type>][;base64],<data>")
    if header.lower().endswith(";base64"):
        if len(payload) * 3 // 4 > max_bytes + 2:  # checked before decoding: the decoded size is known
            raise MediaFetchFailed(f"the data: URL holds more than media.max_bytes ({max_bytes:,} bytes)")
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"the data: URL is not valid base64: {exc}") from None
    else:
        data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise MediaFetchFailed(f"the data: URL holds more than media.max_bytes ({max_bytes:,} bytes)")
    return data


def _read_local(url: str, policy: MediaPolicy) -> Media:
    path = policy.local_file(url)
    try:
        # O_NONBLOCK: opening a FIFO would otherwise wait for a writer before the check below could refuse it.
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):  # a FIFO or a device has no end to read to
                raise MediaRefused(f"{path} is not a regular file")
            data = fh.read(policy.max_bytes + 1)
    except OSError as exc:
        raise MediaFetchFailed(f"could not read media file {path}: {exc.strerror or exc}") from None
    if len(data) > policy.max_bytes:
        raise MediaFetchFailed(f"{path} is larger than media.max_bytes ({policy.max_bytes:,} bytes)")
    return Media(data, None)


def _too_slow(vetted: Vetted) -> str:
    return f"fetching media from {vetted.host} took longer than media.fetch_timeout_s"


def _too_large(vetted: Vetted, max_bytes: int) -> str:
    return f"the media from {vetted.host} is larger than media.max_bytes ({max_bytes:,} bytes)"
