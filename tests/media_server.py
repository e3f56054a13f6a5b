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
    """A loopback HTTP server: the media at `media_path` (/cat.png unless told), /redirect?to=URL, /big (declared too large), /endless (no length, too
    large), /held (answers only once released), /drip and /drip-headers (a byte at a time for 30 s, of the body or
    of the headers), anything else 404. `hits` lists every (path, Host header) asked."""

    def __init__(self, image: bytes = PNG, media_path: str = "/cat.png") -> None:
        self.hits: list[tuple[str, str]] = []
        self.release = threading.Event()
        self.client_left = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.hits.append((self.path, self.headers.get("Host", "")))
                path, query = urlsplit(self.path).path, parse_qs(urlsplit(self.path).query)
                if path == media_path:
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
                elif path in ("/drip", "/drip-headers"):
                    # A byte at a time, each well within any socket timeout, for far longer than a fetch may take.
                    self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                    if path == "/drip":
                        self.wfile.write(b"Content-Type: image/png\r\n\r\n")
                    for _ in range(600):
                        try:
                            self.wfile.write(b"X-Slow: y\r\n" if path == "/drip-headers" else b"y")
                            self.wfile.flush()
                        except OSError:
                            outer.client_left.set()  # the client hung up mid-drip: what the test waits for
                            return
                        if outer.release.wait(0.05):
                            return
                    self.close_connection = True
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
