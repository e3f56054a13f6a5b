"""The http engine: each request POSTed to one OpenAI-compatible server, a bounded number in flight.

A server batches the requests it has at once (vLLM, SGLang, llama.cpp's slots), so sending one at a time — the
classic mistake — leaves it mostly idle; this engine keeps `concurrency` requests in flight on one pooled async
client. The job's plan gives each endpoint a pool of its own (pipeline/job_plan.py), so this engine
talks to exactly one server. Retries and their limits are in http_client.py, what the server tells about itself in
http_probe.py. The body a server returns is the result as is; its own error answers become error records.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from pipeline.endpoints import endpoint_for
from pipeline.engines.base import (
    Engine,
    EngineRequest,
    EngineResult,
    EngineSpec,
    EngineStats,
    error_code_for,
)
from pipeline.engines.http_client import Answer, RetryPolicy, SendStats, ServerUnreachable, post_json
from pipeline.engines.http_probe import ServerInfo, default_concurrency, probe_server
from pipeline.server_urls import endpoint_base

# Requests in flight per endpoint when neither given nor told by the server (matches config.DEFAULT_HTTP_CONCURRENCY;
# engines do not import the job config).
DEFAULT_CONCURRENCY = 64

SERVER_SAMPLING = {
    "set_by": "server",
    "note": "each body is sent as given; a sampling field it leaves unset takes the server's own default (its "
    "model's generation_config for vllm serve; Ollama applies its Modelfile's), which nightshift cannot see",
}


def error_body(status: int, body: Any) -> tuple[dict[str, Any], str]:
    """A server's error answer in OpenAI's error shape, and its message. Servers word errors differently:
    `{"error": {...}}` (OpenAI, vLLM, llama.cpp), `{"object": "error", "message": ...}` (older vLLM),
    `{"error": "text"}` (Ollama), or not JSON at all."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        message, kind, param = str(error.get("message") or ""), error.get("type"), error.get("param")
    elif isinstance(error, str):
        message, kind, param = error, None, None
    elif isinstance(body, dict) and "message" in body:
        message, kind, param = str(body["message"]), body.get("type"), body.get("param")
    else:
        message, kind, param = str(body)[:2000], None, None
    message = message or f"the server answered HTTP {status}"
    code = error_code_for(status, message)
    return {
        "error": {"message": message, "type": kind or "ServerError", "param": param, "code": code.value}
    }, (message)


class HttpEngine(Engine):
    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        endpoints = list(spec.args.get("endpoints") or [])
        if len(endpoints) != 1:
            raise ValueError(f"an http engine sends to one server, got endpoints {endpoints}")
        self.base_url = endpoint_base(endpoints[0])
        self.given_concurrency = spec.args.get("concurrency")
        # Requests in flight on the server: as given, else what the server tells at start (its slots).
        self.limit = int(self.given_concurrency or DEFAULT_CONCURRENCY)
        self.policy = RetryPolicy(
            max_retries=int(spec.args.get("max_retries", 6)),
            backoff_s=float(spec.args.get("backoff_s", 0.5)),
            backoff_max_s=float(spec.args.get("backoff_max_s", 30.0)),
        )
        self.server: ServerInfo | None = None
        self.send_stats = SendStats()
        self._client: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None
        self._inside = 0
        self.peak_in_flight = 0

    @classmethod
    def check_spec(cls, spec: EngineSpec) -> None:
        if not spec.args.get("endpoints"):
            raise ValueError("the http backend needs at least one server: --endpoint URL")

    @classmethod
    def concurrency(cls, args: dict[str, Any]) -> int | None:  # type: ignore[override]
        # The class's answer from args alone; an instance knows the server's slots once started (effective_args).
        value = args.get("concurrency")
        return int(value) if value else None

    @classmethod
    def probe(cls, spec: EngineSpec) -> dict[str, Any]:
        """Each server's identity and traps, on the driver before any work; an unreachable one fails the job."""
        servers = [
            probe_server(endpoint_base(url), spec.api_key, spec.args.get("concurrency"))
            for url in spec.args.get("endpoints") or []
        ]
        return {"servers": [s.as_dict() for s in servers]}

    @classmethod
    def is_engine_dead(cls, exc: BaseException) -> bool:
        # A server that refuses connections through every retry is gone: the chunk must run again (on this
        # engine once Ray restarts it, or another pool's), not become a batch of error records.
        return isinstance(exc, ServerUnreachable)

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.spec.api_key}"} if self.spec.api_key else {}
        self.server = await asyncio.to_thread(
            probe_server, self.base_url, self.spec.api_key, self.given_concurrency
        )
        self.limit = default_concurrency(self.server, self.given_concurrency, DEFAULT_CONCURRENCY)
        # One connection per request in flight, kept alive between requests.
        limits = httpx.Limits(max_connections=self.limit, max_keepalive_connections=self.limit)
        timeout = httpx.Timeout(
            float(self.spec.args.get("timeout_s", 600.0)),
            connect=float(self.spec.args.get("connect_timeout_s", 10.0)),
            pool=None,  # waiting for a free connection is bounded by the slots below, not a timeout
        )
        self._client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, limits=limits, timeout=timeout
        )
        self._slots = asyncio.Semaphore(self.limit)

    async def generate(self, request: EngineRequest) -> EngineResult:
        assert self._client is not None and self._slots is not None, "start() first"
        body = (
            request.body
            if "model" in request.body
            else {**request.body, "model": self.spec.served_model_name}
        )
        async with self._slots:
            self._inside += 1
            self.peak_in_flight = max(self.peak_in_flight, self._inside)
            try:
                answer = await post_json(self._client, request.url, body, self.policy, self.send_stats)
            finally:
                self._inside -= 1
        return self._result(request, answer)

    def _result(self, request: EngineRequest, answer: Answer) -> EngineResult:
        if answer.status_code < 400 and isinstance(answer.body, dict) and "error" not in answer.body:
            endpoint = endpoint_for(request.url)
            prompt, completion = endpoint.usage(answer.body) if endpoint else (0, 0)
            return EngineResult(request.custom_id, answer.status_code, answer.body, None, prompt, completion)
        status = answer.status_code if answer.status_code >= 400 else 502
        body, _ = error_body(status, answer.body)
        if answer.attempts > 1:
            body["error"]["message"] += f" (after {answer.attempts} attempts)"
        return EngineResult(request.custom_id, status, body, error_code_for(status, body["error"]["message"]))

    def effective_args(self) -> dict[str, Any]:
        return {**self.spec.args, "endpoints": [self.base_url], "concurrency": self.limit}

    def sampling_defaults(self) -> dict[str, Any]:
        return dict(SERVER_SAMPLING)

    def stats(self) -> EngineStats:
        return EngineStats(
            extra={
                "server": self.server.as_dict() if self.server else None,
                "peak_requests_inside": self.peak_in_flight,
                **self.send_stats.as_dict(),
            }
        )

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
