"""Real storage endpoints on loopback for the data-plane tests: an S3 server (moto's, over HTTP, with no mocks
patched into boto) and a small HTTP file server that serves GETs, stores PUTs and fails on request."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import uuid
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Endpoint:
    url: str

    def client(self, **overrides):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", **overrides)

    def bucket(self, prefix: str = "bkt") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return name

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def get(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        response = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
        return sorted(obj["Key"] for obj in response.get("Contents", []))

    def enforce_auth(self, on: bool) -> None:
        """moto checks credentials (unknown keys → 403) only when told to; this is server-wide."""
        import urllib.request

        data = b"0" if on else b"inf"
        request = urllib.request.Request(
            f"{self.url}/moto-api/reset-auth", data=data, headers={"Content-Type": "text/plain"}
        )
        urllib.request.urlopen(request).read()


_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": None,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_ENDPOINT_URL": None,
    "AWS_ENDPOINT_URL_S3": None,
    "AWS_PROFILE": None,
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    "AWS_CONFIG_FILE": "/nonexistent",
}
# The test credentials alone: what a Ray cluster started before the moto fixture gives its workers, so their tasks
# reach the local endpoint as the driver does.
TEST_CREDENTIALS = {key: value for key, value in _AWS_ENV.items() if value is not None}


@pytest.fixture(scope="session")
def moto_s3():
    """A moto S3 server on a free loopback port for the whole session; AWS_* set to test credentials."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in _AWS_ENV}
    for key, value in _AWS_ENV.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield S3Endpoint(f"http://127.0.0.1:{port}")
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# -- HTTP --------------------------------------------------------------------------------------------------------------


@dataclass
class HttpFileServer:
    """GET/HEAD serve files from `root`; PUT stores the body under `uploads`; DELETE removes an upload.

    `fail_next(n, methods)` answers the next n requests (of each of `methods`, or of any method) with 503;
    `truncate_next(n)` sends only half of the next n GET bodies (full Content-Length, then the connection closes).
    `etag=False` drops the ETag/Last-Modified headers. `log` holds (method, path, status) of every request.
    """

    root: Path
    uploads: Path
    port: int = 0
    etag: bool = True
    log: list[tuple[str, str, int]] = field(default_factory=list)
    _fail: dict[str, int] = field(default_factory=dict)  # method (or "*") → requests still to fail
    _truncate: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_next(self, n: int, methods: tuple[str, ...] = ()) -> None:
        with self._lock:
            for method in methods or ("*",):
                self._fail[method] = n

    def truncate_next(self, n: int) -> None:
        with self._lock:
            self._truncate = n

    def reset(self) -> None:
        with self._lock:
            self._fail.clear()
            self._truncate = 0
            self.etag = True
            self.log.clear()

    def _take(self, method: str) -> tuple[bool, bool]:
        with self._lock:
            key = method if self._fail.get(method) else "*"
            fail = self._fail.get(key, 0) > 0
            if fail:
                self._fail[key] -= 1
            truncate = method == "GET" and self._truncate > 0 and not fail
            if truncate:
                self._truncate -= 1
            return fail, truncate


def _handler(server: HttpFileServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _path(self, base: Path) -> Path:
            rel = self.path.split("?", 1)[0].lstrip("/")
            return base / rel

        def _status(self, code: int, body: bytes = b"") -> None:
            server.log.append((self.command, self.path, code))
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if body and self.command != "HEAD":
                self.wfile.write(body)

        def _serve(self) -> None:
            fail, truncate = server._take(self.command)
            if fail:
                return self._status(503, b"try again")
            path = self._path(server.root)
            if not path.is_file():
                path = self._path(server.uploads)  # what was PUT can be read back (HEAD of manifest.json)
            if not path.is_file():
                return self._status(404, b"not found")
            data = path.read_bytes()
            server.log.append((self.command, self.path, 200))
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            if server.etag:
                self.send_header("ETag", '"' + hashlib.md5(data).hexdigest() + '"')  # noqa: S324
                self.send_header("Last-Modified", formatdate(path.stat().st_mtime, usegmt=True))
            self.end_headers()
            if self.command == "GET":
                if truncate:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data)

        do_GET = _serve
        do_HEAD = _serve

        def do_PUT(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = self.rfile.read(length)
            fail, _ = server._take("PUT")
            if fail:
                return self._status(503, b"try again")
            path = self._path(server.uploads)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(body)
            self._status(201)

        def do_DELETE(self) -> None:
            fail, _ = server._take("DELETE")
            if fail:
                return self._status(503, b"try again")
            path = self._path(server.uploads)
            if not path.is_file():
                return self._status(404)
            path.unlink()
            self._status(204)

    return Handler


@pytest.fixture(scope="session")
def http_server(tmp_path_factory):
    """A threaded HTTP server on a free loopback port (see HttpFileServer)."""
    base = tmp_path_factory.mktemp("http")
    state = HttpFileServer(base / "files", base / "uploads")
    state.root.mkdir()
    state.uploads.mkdir()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    state.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def http_files(http_server):
    """The session HTTP server, reset (no pending failures) for this test."""
    http_server.reset()
    yield http_server
    http_server.reset()
