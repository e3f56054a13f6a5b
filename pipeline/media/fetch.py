"""Media fetched as the policy allows (media/policy.py): every hop of a redirect checked, the connection made to the
address that was checked, at most `max_bytes` read, within `fetch_timeout_s` in all.

    media = fetch_media("https://images.example.com/cat.png", policy)   # Media(data, content_type)
    # MediaRefused: the policy forbids the URL or a redirect's target; nothing was fetched from it
    # MediaFetchFailed: the server could not be reached, answered an error, sent too much or too slowly

Either is the row's error, never the job's. Runs in the process that runs the row (the engine's), with urllib3: a
connection pinned to the checked address (TLS still verifies the host's own name) is what it offers and the
standard library does not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import urllib3

from pipeline.media.policy import MediaFetchFailed, MediaPolicy, MediaRefused, Resolver, Vetted

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 1 << 16


@dataclass(frozen=True)
class Media:
    data: bytes
    content_type: str | None


def fetch_media(url: str, policy: MediaPolicy, resolve: Resolver | None = None) -> Media:
    """The bytes of an http(s):// or (under allowed_local_media_path) file:// media URL."""
    if urlsplit(url).scheme.lower() == "file":
        return _read_local(url, policy)
    deadline = time.monotonic() + policy.fetch_timeout_s
    for _ in range(policy.max_redirects + 1):
        vetted = policy.vet(url, resolve)
        response = _get(vetted, deadline)
        try:
            if response.status in _REDIRECTS:
                location = response.headers.get("Location")
                if not location:
                    raise MediaFetchFailed(f"{vetted.host} answered {response.status} with no Location")
                url = urljoin(url, location)
                scheme = urlsplit(url).scheme.lower()
                if scheme not in (
                    "http",
                    "https",
                ):  # never to file://, data:, gopher://...: each is vetted apart
                    raise MediaRefused(
                        f"a redirect to a {scheme}: URL (redirects are followed to http(s) only)"
                    )
                continue
            if response.status >= 400:
                raise MediaFetchFailed(f"{vetted.host} answered {response.status} for the media URL")
            return Media(
                _read_capped(response, vetted, policy.max_bytes, deadline),
                response.headers.get("Content-Type"),
            )
        finally:
            response.release_conn()
    raise MediaFetchFailed(f"more than {policy.max_redirects} redirects (media.max_redirects)")


def _get(vetted: Vetted, deadline: float) -> urllib3.BaseHTTPResponse:
    left = deadline - time.monotonic()
    if left <= 0:
        raise MediaFetchFailed(_too_slow(vetted))
    timeout = urllib3.Timeout(connect=left, read=left)
    if vetted.scheme == "https":
        pool: urllib3.HTTPConnectionPool = urllib3.HTTPSConnectionPool(
            vetted.address,
            vetted.port,
            timeout=timeout,
            maxsize=1,
            retries=False,
            server_hostname=vetted.host,  # SNI and the certificate's name are the host's, not the address's
            assert_hostname=vetted.host,
            cert_reqs="CERT_REQUIRED",
        )
    else:
        pool = urllib3.HTTPConnectionPool(
            vetted.address, vetted.port, timeout=timeout, maxsize=1, retries=False
        )
    default_port = 443 if vetted.scheme == "https" else 80
    host = f"[{vetted.host}]" if ":" in vetted.host else vetted.host
    headers = {
        "Host": host if vetted.port == default_port else f"{host}:{vetted.port}",
        "User-Agent": "nightshift-media-fetch",
        "Accept-Encoding": "identity",  # max_bytes counts what is stored, not what a compressor makes of it
    }
    try:
        return pool.urlopen(
            "GET", vetted.target, headers=headers, redirect=False, retries=False, preload_content=False
        )
    except urllib3.exceptions.NewConnectionError as exc:  # before TimeoutError: urllib3 derives it from that
        raise MediaFetchFailed(f"could not fetch media from {vetted.host}: {_reason(exc)}") from None
    except urllib3.exceptions.TimeoutError:
        raise MediaFetchFailed(_too_slow(vetted)) from None
    except urllib3.exceptions.HTTPError as exc:
        raise MediaFetchFailed(f"could not fetch media from {vetted.host}: {_reason(exc)}") from None


def _read_capped(
    response: urllib3.BaseHTTPResponse, vetted: Vetted, max_bytes: int, deadline: float
) -> bytes:
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise MediaFetchFailed(_too_large(vetted, max_bytes))
    chunks, total = [], 0
    try:
        for chunk in response.stream(_CHUNK, decode_content=False):
            total += len(chunk)
            if total > max_bytes:
                raise MediaFetchFailed(_too_large(vetted, max_bytes))
            if time.monotonic() > deadline:
                raise MediaFetchFailed(_too_slow(vetted))
            chunks.append(chunk)
    except urllib3.exceptions.TimeoutError:
        raise MediaFetchFailed(_too_slow(vetted)) from None
    except urllib3.exceptions.HTTPError as exc:
        raise MediaFetchFailed(f"could not fetch media from {vetted.host}: {_reason(exc)}") from None
    return b"".join(chunks)


def _read_local(url: str, policy: MediaPolicy) -> Media:
    path = policy.local_file(url)
    try:
        size = path.stat().st_size
        if size > policy.max_bytes:
            raise MediaFetchFailed(
                f"{path} is {size:,} bytes, more than media.max_bytes ({policy.max_bytes:,})"
            )
        return Media(path.read_bytes(), None)
    except OSError as exc:
        raise MediaFetchFailed(f"could not read media file {path}: {exc.strerror or exc}") from None


def _too_slow(vetted: Vetted) -> str:
    return f"fetching media from {vetted.host} took longer than media.fetch_timeout_s"


def _too_large(vetted: Vetted, max_bytes: int) -> str:
    return f"the media from {vetted.host} is larger than media.max_bytes ({max_bytes:,} bytes)"


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or exc
    return str(reason)
