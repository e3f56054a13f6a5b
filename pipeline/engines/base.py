"""The engine seam: the one interface every backend (vllm, fake, later http) implements.

An engine takes one request at a time through `generate`; callers get continuous batching by keeping many
`generate` coroutines in flight at once (the runtime keeps about 2 x max_num_seqs per engine). Engines know nothing
of Ray Data: the runtime drives them, tests drive them directly.
"""

from __future__ import annotations

import asyncio
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pipeline.protocol import ErrorCode


@dataclass(frozen=True)
class EngineRequest:
    custom_id: str
    url: str  # one of protocol.Route
    body: dict[str, Any]


@dataclass
class EngineResult:
    """What came back for one request: a response body (success) or an error body, plus token counts."""

    custom_id: str
    status_code: int
    body: dict[str, Any]
    error_code: ErrorCode | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status_code < 400


@dataclass
class EngineStats:
    """The engine's own numbers, as far as a backend can report them."""

    kv_cache_tokens: int | None = None  # KV capacity the engine allocated
    kv_cache_usage: float | None = None  # 0..1, last reading
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to build an engine in another process (picklable; sent to Ray actors)."""

    backend: str
    model_path: str
    served_model_name: str
    args: dict[str, Any]
    # CPUs the runtime reserved for this engine (Ray num_cpus): a CPU engine computes on that many cores of its own.
    cpus: float = 0.0
    # The cores the runtime claimed for a CPU engine on its node (no other engine computes on them); None: the
    # backend binds its threads as it would on its own.
    cpu_cores: tuple[int, ...] | None = None


def unexpected_error_result(custom_id: str, exc: BaseException) -> EngineResult:
    """A request the engine failed on in a way it did not report itself: a 500 with the exception's message."""
    message = f"the engine failed on this request: {type(exc).__name__}: {exc}"
    body = {
        "error": {
            "message": message,
            "type": "InternalServerError",
            "param": None,
            "code": ErrorCode.ENGINE_ERROR.value,
        }
    }
    return EngineResult(custom_id, 500, body, ErrorCode.ENGINE_ERROR)


class Engine(ABC):
    """One model engine. Lifecycle: start() once, generate() concurrently, stats() any time, stop() once."""

    # Whether an engine given no GPU computes on the host's CPU cores: then, unless told otherwise, the runtime
    # gives it whole cores of its node (the more cores, the faster), rather than one Ray CPU.
    computes_on_cpu_cores: bool = False

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec

    @classmethod
    def check_spec(cls, spec: EngineSpec) -> None:
        """Reject unusable engine args on the driver, before any work starts (raise ValueError)."""
        return None

    @classmethod
    def rows_per_second(cls, spec: EngineSpec) -> float | None:
        """How many rows one engine finishes per second, when the backend knows it without running (the fake
        engine's time model); None when only running tells (real engines). The runtime sizes work chunks by it:
        per-chunk overhead is fixed, so a fast engine gets large chunks and a slow one small, frequent ones."""
        return None

    @classmethod
    def preload(cls) -> None:
        """Import what start() needs, ahead of it. The runtime calls this on a thread as soon as an engine actor
        exists, so seconds of imports overlap the wait for its first chunk of work instead of following it."""
        return None

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def generate(self, request: EngineRequest) -> EngineResult:
        """Run one request to completion. Should not raise for a bad request (return an error result); `answer`
        is the safety net for whatever still does."""

    @classmethod
    def is_engine_dead(cls, exc: BaseException) -> bool:
        """Whether an exception means the engine itself is gone (the runtime replaces it), rather than one
        request failing (that request's error record)."""
        return False

    async def answer(self, request: EngineRequest) -> EngineResult:
        """`generate`, with any exception but the engine's death turned into this request's `engine_error`
        result: one request, whatever it holds, never fails the chunk it came in (nor the job)."""
        try:
            return await self.generate(request)
        except Exception as exc:
            if self.is_engine_dead(exc):
                raise
            return unexpected_error_result(request.custom_id, exc)

    async def generate_all(
        self, requests: list[EngineRequest], slots: asyncio.Semaphore | None = None
    ) -> list[EngineResult]:
        """Run requests concurrently, each holding one of `slots` while inside the engine; results in order.

        This is how continuous batching is fed: many `answer` coroutines at once. A backend that can answer a
        chunk without waiting on anything may override it and skip the per-request tasks."""

        async def one(request: EngineRequest) -> EngineResult:
            if slots is None:
                return await self.answer(request)
            async with slots:
                return await self.answer(request)

        return list(await asyncio.gather(*(one(request) for request in requests)))

    def stats(self) -> EngineStats:
        return EngineStats()

    def effective_args(self) -> dict[str, Any]:
        """The engine args actually in force (after defaults and fitting), for the manifest."""
        return dict(self.spec.args)

    def sampling_defaults(self) -> dict[str, Any]:
        """Sampling defaults the engine applies when a request leaves a field unset (e.g. generation_config)."""
        return {}

    async def stop(self) -> None:  # noqa: B027 - optional hook
        pass

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Synchronous last-resort cleanup (actor teardown): stop child processes, free memory."""


# Backend name -> "module:Class"; imported only when used, so `nightshift --help` never imports vLLM.
BACKENDS: dict[str, str] = {
    "vllm": "pipeline.engines.vllm_engine:VllmEngine",
    "fake": "pipeline.engines.fake:FakeEngine",
}


def engine_class(backend: str) -> type[Engine]:
    try:
        target = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown engine backend {backend!r}; choose one of {sorted(BACKENDS)}") from None
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def build_engine(spec: EngineSpec) -> Engine:
    return engine_class(spec.backend)(spec)
