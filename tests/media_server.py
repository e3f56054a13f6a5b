"""A loopback HTTP server that serves media and records every request it gets: what the media fetch policy's tests
fetch from (and prove nothing was fetched from)."""

from __future__ import annotations

import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


def png(size: int = 8) -> bytes:
    """A real PNG image, size x size pixels."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (200, 40, 40)).save(buffer, "PNG")
    return buffer.getvalue()


PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4  # PNG's magic, then bytes no decoder takes


class MediaServer:
    """A loopback HTTP server: /cat.png, /redirect?to=URL, /big (declared too large), /endless (no length, too
    large), /held (answers only once released), anything else 404. `hits` lists every (path, Host header) asked."""

    def __init__(self, image: bytes = PNG) -> None:
        self.hits: list[tuple[str, str]] = []
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.hits.append((self.path, self.headers.get("Host", "")))
                path, query = urlsplit(self.path).path, parse_qs(urlsplit(self.path).query)
                if path == "/cat.png":
                    self._send(200, image, {"Content-Type": "image/png"})
                elif path == "/redirect":
                    self._send(302, b"", {"Location": query["to"][0]})
                elif path == "/big":
                    self._send(200, b"x" * 2048, {})
                elif path == "/endless":
                    self.send_response(200)
                    self.end_headers()  # no Content-Length: the body ends when the connection does
                    for _ in range(64):
                        self.wfile.write(b"y" * 1024)
                    self.close_connection = True
                elif path == "/held":
                    outer.release.wait(30)
                    self._send(200, image, {})
                else:
                    self._send(404, b"not here", {})

            def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
