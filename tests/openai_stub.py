"""A small OpenAI-compatible server on a loopback port, with faults on request: what the http engine's tests talk to.

The faults are scripted by the request itself, in its last message's content (or prompt), so a test states them
beside the request: `[429x2]` answers the first two attempts 429 with `Retry-After`, `[500x1]` one 500, `[dropx1]`
closes the first connection without answering, `[slowx1]` answers the first attempt after `slow_s`, `[400]` is the
request's own fault (always 400), `[long]` a 400 worded as vLLM's context-length rejection. Every attempt and every
answer is counted per content, so a test can tell what was retried and that nothing was answered twice.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_FAULT = re.compile(r"\[(429|500|drop|slow)x(\d+)\]")
MODEL = "smollm2-135m-instruct"


class StubState:
    def __init__(
        self, model: str, kind: str, slots: int | None, slow_s: float, delay_s: float, api_key: str | None
    ):
        self.model, self.kind, self.slots = model, kind, slots
        self.slow_s, self.delay_s, self.api_key = slow_s, delay_s, api_key
        self.retry_after = "0.2"
        self.lock = threading.Lock()
        self.attempts: Counter = Counter()  # per content: requests received
        self.answered: Counter = Counter()  # per content: 200s sent
        self.attempt_times: dict[str, list[float]] = defaultdict(list)
        self.inside = 0
        self.peak_inside = 0
        self.unauthorized = 0


def _content(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][-1].get("content", ""))
    return str(body.get("prompt", ""))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real server: the client's connection pool is exercised
    state: StubState

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.state.api_key and self.headers.get("Authorization") != f"Bearer {self.state.api_key}":
            with self.state.lock:
                self.state.unauthorized += 1
            self._send(401, {"error": {"message": "invalid api key", "type": "auth"}})
            return False
        return True

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        s = self.state
        if not self._authorized():
            return
        if self.path == "/v1/models":
            self._send(
                200, {"object": "list", "data": [{"id": s.model, "object": "model", "owned_by": s.kind}]}
            )
        elif self.path == "/version" and s.kind == "vllm":
            self._send(200, {"version": "0.0-stub"})
        elif self.path == "/props" and s.kind == "llama.cpp":
            self._send(200, {"total_slots": s.slots, "default_generation_settings": {"n_ctx": 1024}})
        elif self.path == "/api/version" and s.kind == "ollama":
            self._send(200, {"version": "0.9.0"})
        else:
            self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

    def do_POST(self) -> None:  # noqa: N802
        s = self.state
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not self._authorized():
            return
        content = _content(body)
        with s.lock:
            s.attempts[content] += 1
            attempt = s.attempts[content]
            s.attempt_times[content].append(time.monotonic())
            s.inside += 1
            s.peak_inside = max(s.peak_inside, s.inside)
        try:
            self._answer(body, content, attempt)
        finally:
            with s.lock:
                s.inside -= 1

    def _answer(self, body: dict[str, Any], content: str, attempt: int) -> None:
        s = self.state
        for kind, times in _FAULT.findall(content):
            if attempt > int(times):
                continue
            if kind == "429":
                self._send(
                    429,
                    {"error": {"message": "slow down", "type": "rate_limit"}},
                    {"Retry-After": s.retry_after},
                )
                return
            if kind == "500":
                self._send(500, {"error": {"message": "boom", "type": "server_error"}})
                return
            if kind == "drop":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if kind == "slow":
                time.sleep(s.slow_s)
        if "[400]" in content:
            self._send(
                400,
                {
                    "error": {
                        "message": "temperature must be >= 0",
                        "type": "BadRequestError",
                        "param": "temperature",
                        "code": 400,
                    }
                },
            )
            return
        if "[long]" in content:
            message = "This model's maximum context length is 64 tokens. However, you requested 99 tokens."
            self._send(400, {"object": "error", "message": message, "type": "BadRequestError", "code": 400})
            return
        if s.delay_s:
            time.sleep(s.delay_s)
        max_tokens = int(body.get("max_tokens") or 4)
        words = content.split()[:max_tokens]
        usage = {
            "prompt_tokens": len(content.split()),
            "completion_tokens": len(words),
            "total_tokens": len(content.split()) + len(words),
        }
        if self.path == "/v1/chat/completions":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": " ".join(words)},
                "finish_reason": "length",
            }
            answer = {
                "id": "chatcmpl-stub",
                "object": "chat.completion",
                "created": 1,
                "model": body.get("model"),
                "choices": [choice],
                "usage": usage,
            }
        elif self.path == "/v1/completions":
            choice = {"index": 0, "text": " ".join(words), "finish_reason": "length"}
            answer = {
                "id": "cmpl-stub",
                "object": "text_completion",
                "created": 1,
                "model": body.get("model"),
                "choices": [choice],
                "usage": usage,
            }
        else:
            self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
            return
        try:
            self._send(200, answer)
        except OSError:
            return  # the client gave up waiting (its timeout): this answer never reached it
        with s.lock:
            s.answered[content] += 1


class OpenAIStub:
    """`with OpenAIStub() as stub:` a server at `stub.url`; `stub.state` holds what it saw."""

    def __init__(
        self,
        model: str = MODEL,
        kind: str = "vllm",
        slots: int | None = None,
        slow_s: float = 1.0,
        delay_s: float = 0.0,
        api_key: str | None = None,
    ) -> None:
        self.state = StubState(model, kind, slots, slow_s, delay_s, api_key)
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # a client that hung up is part of the tests
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="openai-stub", daemon=True)

    def __enter__(self) -> OpenAIStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
