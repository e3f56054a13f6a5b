"""Where data lives — a local path, `s3://bucket/prefix`, or an `http(s)://` URL — and how to reach it.

Shared by the readers (input) and the writers (output): parsing a location, the S3 filesystem (s3fs, credentials
and endpoint from the usual AWS environment), plain HTTP requests (urllib), the retry policy for transient errors
(exponential backoff, bounded, every retry logged), and the wording of storage errors so that a bad location fails
with a message that says what to change.
"""

from __future__ import annotations

import http.client
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import structlog

from pipeline.config import StorageConfig

log = structlog.get_logger(__name__)

T = TypeVar("T")
Kind = Literal["local", "s3", "http"]

GLOB_CHARS = ("*", "?", "[")


class LocationError(ValueError):
    """A location that cannot be used; the message says what to change."""


# -- locations --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Location:
    kind: Kind
    raw: str  # as the user wrote it
    path: str  # local: the expanded path; s3: "bucket/key"; http: the URL

    @property
    def bucket(self) -> str:
        return self.path.split("/", 1)[0]

    @property
    def key(self) -> str:
        parts = self.path.split("/", 1)
        return parts[1] if len(parts) > 1 else ""

    @property
    def url(self) -> str:
        if self.kind == "s3":
            return f"s3://{self.path}"
        if self.kind == "http":
            return self.path
        return self.path

    def has_glob(self) -> bool:
        target = self.key if self.kind == "s3" else self.path
        return self.kind != "http" and any(c in target for c in GLOB_CHARS)


def parse_location(text: str) -> Location:
    """`s3://b/k`, `http(s)://…` or a local path (`~` expanded). Other schemes are refused by name."""
    text = text.strip()
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme in ("s3", "s3a"):
        path = text.split("://", 1)[1].lstrip("/")
        if not path or path.startswith("/"):
            raise LocationError(f"{text}: an S3 location needs a bucket, e.g. s3://my-bucket/batches/")
        return Location("s3", text, path)
    if scheme in ("http", "https"):
        if not urllib.parse.urlsplit(text).netloc:
            raise LocationError(f"{text}: the URL has no host")
        return Location("http", text, text)
    if scheme == "file":
        return Location("local", text, os.path.expanduser(urllib.parse.urlsplit(text).path))
    if scheme:
        raise LocationError(
            f"{text}: unsupported scheme {scheme}://; use a local path, s3://bucket/prefix or an http(s):// URL"
        )
    return Location("local", text, os.path.expanduser(text))


def join_url(base: str, name: str) -> str:
    """`base/name`, keeping a query string (e.g. a token) on the joined URL."""
    parts = urllib.parse.urlsplit(base)
    path = parts.path.rstrip("/") + "/" + urllib.parse.quote(name)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def redact_url(url: str) -> str:
    """A URL fit for logs and manifests: no query string (presigned URLs carry credentials there)."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    suffix = "?…" if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", "")) + suffix


# -- retries ----------------------------------------------------------------------------------------------------------


class HttpStatusError(OSError):
    """An HTTP request answered with an error status."""

    def __init__(self, method: str, url: str, status: int, reason: str = "") -> None:
        super().__init__(f"{method} {redact_url(url)}: HTTP {status} {reason}".strip())
        self.method = method
        self.url = url
        self.status = status
        self.reason = reason


TRANSIENT_HTTP = {408, 425, 429, 500, 502, 503, 504}
TRANSIENT_S3_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
}


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def s3_error_code(exc: BaseException) -> tuple[str | None, int | None]:
    """(error code, HTTP status) of a botocore ClientError anywhere in the exception chain."""
    for err in _chain(exc):
        response = getattr(err, "response", None)
        if isinstance(response, dict) and "Error" in response:
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return response["Error"].get("Code"), status
    return None, None


def _is_connection_error(exc: BaseException) -> bool:
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:  # pragma: no cover - botocore comes with s3fs
        BotoConnectionError = HTTPClientError = ()  # type: ignore[assignment,misc]
    for err in _chain(exc):
        if isinstance(err, BotoConnectionError | HTTPClientError):
            return True
        if isinstance(err, ConnectionError | TimeoutError | socket.timeout | http.client.HTTPException):
            return True
        if isinstance(err, urllib.error.URLError) and not isinstance(err, urllib.error.HTTPError):
            return True
        if type(err).__module__.startswith("aiohttp") and "Client" in type(err).__name__:
            return True
    return False


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: connection trouble, timeouts, throttling and server-side (5xx) errors."""
    if isinstance(exc, HttpStatusError):
        return exc.status in TRANSIENT_HTTP
    code, status = s3_error_code(exc)
    if code is not None:
        return code in TRANSIENT_S3_CODES or (status is not None and status >= 500)
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return False
    return _is_connection_error(exc)


@dataclass
class RetryPolicy:
    retries: int = 4
    backoff_s: float = 0.5
    backoff_max_s: float = 20.0

    @classmethod
    def from_config(cls, storage: StorageConfig | None) -> RetryPolicy:
        storage = storage or StorageConfig()
        return cls(storage.retries, storage.retry_backoff_s, storage.retry_backoff_max_s)

    def delay(self, retry: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * (2 ** (retry - 1)))


class RetryStats:
    """Process-wide count of storage retries; a job reports the difference between two snapshots."""

    _by_operation: dict[str, int] = {}

    @classmethod
    def record(cls, what: str) -> None:
        op = what.split(" ", 1)[0]
        cls._by_operation[op] = cls._by_operation.get(op, 0) + 1

    @classmethod
    def snapshot(cls) -> dict[str, int]:
        return dict(cls._by_operation)

    @classmethod
    def add(cls, by_operation: dict[str, int]) -> None:
        """Count retries another process made on this job's behalf (a task's `since(...)["by_operation"]`)."""
        for op, n in by_operation.items():
            cls._by_operation[op] = cls._by_operation.get(op, 0) + n

    @classmethod
    def since(cls, before: dict[str, int]) -> dict[str, Any]:
        """Retries since `before` (a snapshot): {"retries": total, "by_operation": {op: n}}."""
        delta = {op: n - before.get(op, 0) for op, n in cls._by_operation.items() if n > before.get(op, 0)}
        return {"retries": sum(delta.values()), "by_operation": delta}


def with_retries(
    fn: Callable[[], T],
    what: str,
    policy: RetryPolicy,
    transient: Callable[[BaseException], bool] = is_transient,
) -> T:
    """Call `fn`; on a transient error wait (exponential backoff) and try again, at most `policy.retries` times."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:
            if attempt > policy.retries or not transient(exc):
                raise
            delay = policy.delay(attempt)
            RetryStats.record(what)
            log.warning(
                "storage request failed, retrying",
                op=what,
                attempt=attempt,
                of=policy.retries + 1,
                error=f"{type(exc).__name__}: {exc}",
                retry_in_s=round(delay, 2),
            )
            time.sleep(delay)


# -- S3 ---------------------------------------------------------------------------------------------------------------


def s3_endpoint(storage: StorageConfig) -> str | None:
    return (
        storage.s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )


def s3_filesystem(storage: StorageConfig | None):
    """An s3fs filesystem. Its own retry loops are turned off: `with_retries` retries (and logs) instead."""
    try:
        import s3fs
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise LocationError("s3:// locations need s3fs: pip install 'nightshift-batch[s3]'") from exc
    storage = storage or StorageConfig()
    client_kwargs: dict[str, Any] = {}
    region = storage.s3_region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        client_kwargs["region_name"] = region
    fs = s3fs.S3FileSystem(
        anon=storage.s3_anon,
        endpoint_url=s3_endpoint(storage),
        client_kwargs=client_kwargs,
        config_kwargs={
            "connect_timeout": storage.timeout_s,
            "read_timeout": storage.timeout_s,
            "retries": {"max_attempts": 1, "mode": "standard"},
        },
        skip_instance_cache=True,
        use_listings_cache=False,
    )
    fs.retries = 1
    return fs


def s3_problem(exc: BaseException, url: str, storage: StorageConfig | None, action: str) -> str:
    """What went wrong with an S3 location, and what to change — for a PreflightError message."""
    storage = storage or StorageConfig()
    endpoint = s3_endpoint(storage) or "AWS S3"
    code, status = s3_error_code(exc)
    bucket = parse_location(url).bucket if url.startswith("s3") else url
    names = {type(e).__name__ for e in _chain(exc)}
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return (
            f"cannot {action} {url}: no S3 credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE), or use storage.s3_anon for a public bucket"
        )
    if code == "NoSuchBucket":
        return f"cannot {action} {url}: bucket {bucket!r} does not exist at {endpoint}; check the bucket name"
    if (
        code
        in {
            "AccessDenied",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "ExpiredToken",
            "InvalidToken",
            "AllAccessDisabled",
            "403",
            "Forbidden",
        }
        or status == 403
        or (code is None and isinstance(exc, PermissionError))
    ):
        detail = f" ({code})" if code else ""
        return (
            f"cannot {action} {url}: access denied{detail} at {endpoint}; check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the bucket policy"
        )
    if code is None and _is_connection_error(exc):
        return (
            f"cannot {action} {url}: S3 endpoint {endpoint} is unreachable ({type(exc).__name__}: {exc}); "
            "check --s3-endpoint-url / AWS_ENDPOINT_URL and the network"
        )
    detail = f"{code}: {exc}" if code else f"{type(exc).__name__}: {exc}"
    return f"cannot {action} {url}: {detail}"


# -- HTTP -------------------------------------------------------------------------------------------------------------


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects as urllib follows them, but the job's headers (an Authorization) go only to the origin they were
    given for, and never from https to plain http: a server that redirects elsewhere does not get to hand the
    token to another host, nor in clear over the network."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201 - urllib's signature
        old, new = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        if old.scheme == "https" and new.scheme != "https":
            raise urllib.error.HTTPError(
                req.full_url,
                code,
                f"refused a redirect from https to {new.scheme}: {redact_url(newurl)}",
                headers,
                fp,
            )
        redirected = super().redirect_request(req, fp, code, msg, headers, newurl)
        if redirected is not None and (old.scheme, old.netloc) != (new.scheme, new.netloc):
            for name in getattr(req, "secret_headers", ()):
                redirected.remove_header(name.capitalize())
        return redirected


_OPENER = urllib.request.build_opener(_SameOriginRedirects)


def http_open(
    method: str,
    url: str,
    storage: StorageConfig | None,
    data: Any = None,
    headers: dict[str, str] | None = None,
) -> http.client.HTTPResponse:
    """One HTTP request; an error status raises HttpStatusError (transient for 5xx/429/408). The job's own headers
    (storage.http_headers) follow a redirect only within their origin (_SameOriginRedirects)."""
    storage = storage or StorageConfig()
    request = urllib.request.Request(url, data=data, method=method)
    secret = storage.header_values()
    for name, value in {**secret, **(headers or {})}.items():
        request.add_header(name, value)
    request.secret_headers = tuple(secret)  # type: ignore[attr-defined]
    try:
        return _OPENER.open(request, timeout=storage.timeout_s)
    except urllib.error.HTTPError as exc:
        exc.close()
        raise HttpStatusError(method, url, exc.code, str(exc.reason)) from None


def http_problem(exc: BaseException, url: str, action: str) -> str:
    shown = redact_url(url)
    if isinstance(exc, HttpStatusError):
        if exc.status == 404:
            return f"cannot {action} {shown}: not found (HTTP 404); check the URL"
        if exc.status in (401, 403):
            return (
                f"cannot {action} {shown}: access denied (HTTP {exc.status}); check the URL's signature/expiry "
                "or storage.http_headers (e.g. Authorization)"
            )
        return f"cannot {action} {shown}: HTTP {exc.status} {exc.reason}".strip()
    reason = getattr(exc, "reason", None) or exc
    return f"cannot {action} {shown}: unreachable ({reason}); check the host, port and network"
