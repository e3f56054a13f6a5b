"""The engine seam: the one interface every backend (vllm, http, fake) implements, and the registry of backends.

An engine takes one request at a time through `generate`; callers get continuous batching by keeping many
`generate` coroutines in flight at once (the runtime keeps about 2 x max_num_seqs per engine). Engines know nothing
of Ray Data: the runtime drives them, tests drive them directly.
"""

from __future__ import annotations

import asyncio
import importlib
import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from pipeline.media.policy import MediaFetchFailed, MediaPolicy, MediaRefused
from pipeline.protocol import ErrorCode

if TYPE_CHECKING:
    from pipeline.engines.fitting import FitStrategy


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
    # time.monotonic() in the engine's process when the request entered the engine and when its answer was back;
    # None where a backend answers a chunk at once (the runtime then times the chunk).
    started_at: float | None = None
    finished_at: float | None = None

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
    # LoRA adapters loaded into the engine's slots (first loads and swaps); None: it serves no adapters.
    adapter_loads: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def since(self, start: EngineStats | None) -> EngineStats:
        """These numbers counted from `start` on (the engine's counters when a job took it warm): what this job
        did, not what the engine did for every job before it. Gauges (KV capacity and usage) are as they are."""
        if start is None:
            return self
        loads = self.adapter_loads
        if loads is not None and start.adapter_loads is not None:
            loads -= start.adapter_loads
        return replace(
            self,
            num_preemptions=self.num_preemptions - start.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries - start.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits - start.prefix_cache_hits,
            adapter_loads=loads,
        )


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
    # Its LoRA adapters (args' lora_modules) as directories on its node, staged there by the runtime
    # (io/adapter_files.py); None: none staged (the engine serves none, or reads no files for them).
    adapter_dirs: dict[str, str] | None = None
    # The job's storage settings (config.StorageConfig: endpoint, region, ...) its s3:// adapters are read with.
    adapter_storage: Any = field(default=None, repr=False)
    # A bearer token for the backend's servers (http). Kept out of `args`, which are logged and written to the
    # manifest; repr=False keeps it out of logs of the spec itself.
    api_key: str | None = field(default=None, repr=False)
    # Where the media its requests name may be fetched from (media/policy.py), by a backend that fetches them.
    media: MediaPolicy = field(default_factory=MediaPolicy)


# vLLM words its context-length rejections several ways (renderer, sampling-param fitting); all mean the same.
_CONTEXT_LENGTH = re.compile(
    r"maximum context length|exceeds model's maximum|context length \(|longer than the maximum model length",
    re.IGNORECASE,
)


def error_code_for(status_code: int, message: str) -> ErrorCode:
    """The stable error code of a request an engine (or a server) rejected with this status and message."""
    if _CONTEXT_LENGTH.search(message):
        return ErrorCode.CONTEXT_LENGTH_EXCEEDED
    if MediaRefused.prefix in message:
        return ErrorCode.MEDIA_REFUSED
    if MediaFetchFailed.prefix in message:
        return ErrorCode.MEDIA_FETCH_FAILED
    return ErrorCode.INVALID_REQUEST if status_code < 500 else ErrorCode.ENGINE_ERROR


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
    # Whether it loads its LoRA adapters' files (lora_modules): then the runtime checks them before any work and
    # stages them on each engine's node (spec.adapter_dirs).
    reads_adapter_files: bool = False

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
    def concurrency(cls, args: dict[str, Any]) -> int | None:
        """Requests one engine runs at once with these args (vLLM's max_num_seqs), or None when only the started
        engine knows. The runtime keeps about twice that inside the engine, so its batch stays full."""
        value = args.get("max_num_seqs") or args.get("max_concurrency")
        return int(value) if value else None

    @classmethod
    def probe(cls, spec: EngineSpec) -> dict[str, Any]:
        """What the driver learns about the backend before any work (e.g. each server's identity), for the
        manifest; raise ValueError, saying what to change, when it cannot serve the job."""
        return {}

    @classmethod
    def media_tokens(cls, model: Any, args: dict[str, Any]) -> dict[str, int]:
        """Prompt tokens one media item takes in `model`'s prompts (a ResolvedModel) with these engine args, by
        modality, for fitting to count; {} when the backend cannot tell or the model takes no media."""
        return {}

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
                started = time.monotonic()
                return _timed(await self.answer(request), started)
            async with slots:
                # Timed from here: the wait for a slot is queueing, not the engine's time.
                started = time.monotonic()
                return _timed(await self.answer(request), started)

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


def _timed(result: EngineResult, started: float) -> EngineResult:
    result.started_at = started if result.started_at is None else result.started_at
    result.finished_at = time.monotonic() if result.finished_at is None else result.finished_at
    return result


@dataclass(frozen=True)
class Backend:
    """One engine backend: what the rest of nightshift needs to know about it, in one place.

    Its args are the job config's `engine.<name>` block (pipeline/config.py); what its engines do at run time
    (how many requests they run at once, how their death shows, which resources they compute on) are classmethods
    of its engine class. Adding a backend is one entry here, one engine module and one config block."""

    name: str
    engine: str  # "module:Class", imported only when used, so `nightshift --help` never imports vLLM
    # What fitting can know before any engine starts: "module:function", the backend's fit strategy beside its
    # engine (engines/fitting.py; imported only when a job is fitted), or None — nothing: the engine args are
    # someone else's (a server's), so fitting is skipped, for `no_fit_reason`.
    fitting: str | None
    # Where the model comes from: "local" — a directory, hub id or embedded model the engine loads itself;
    # "server" — the backend's servers serve their own, named by their /v1/models.
    model_source: Literal["local", "server"]
    # Runs vLLM in this job's processes: `run` makes doctor's install checks first.
    runs_vllm: bool
    no_fit_reason: str | None = None  # why fitting is skipped, for the manifest (fitting None)
    # Whether fitting sizes max_num_seqs to the KV cache (vLLM); the fake's concurrency is its own setting.
    fits_max_num_seqs: bool = False


BACKENDS: dict[str, Backend] = {
    "vllm": Backend(
        "vllm",
        "pipeline.engines.vllm_engine:VllmEngine",
        "pipeline.engines.vllm_engine:fit_target",
        "local",
        runs_vllm=True,
        fits_max_num_seqs=True,
    ),
    "http": Backend(
        "http",
        "pipeline.engines.http:HttpEngine",
        None,
        "server",
        runs_vllm=False,
        no_fit_reason="the http backend sends requests to servers whose engine args are their own",
    ),
    "fake": Backend(
        "fake",
        "pipeline.engines.fake:FakeEngine",
        "pipeline.engines.fake:fit_target",
        "local",
        runs_vllm=False,
    ),
}
BACKEND_NAMES: tuple[str, ...] = tuple(BACKENDS)


def backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown engine backend {name!r}; choose one of {sorted(BACKENDS)}") from None


def engine_class(name: str) -> type[Engine]:
    module_name, class_name = backend(name).engine.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def fit_strategy(name: str) -> FitStrategy | None:
    """The backend's fit strategy (engines/fitting.py), None when its engine args are not nightshift's to fit."""
    ref = backend(name).fitting
    if ref is None:
        return None
    module_name, function_name = ref.split(":")
    return getattr(importlib.import_module(module_name), function_name)


def build_engine(spec: EngineSpec) -> Engine:
    return engine_class(spec.backend)(spec)


# Engine args a running engine may differ in from the plan it is asked to serve, and still serve it (see
# engine_covers); any other difference means building the engine again.
_COVERING_ARGS = ("max_model_len", "max_num_seqs")


def engine_covers(built: EngineSpec | None, wanted: EngineSpec) -> bool:
    """Whether an engine built for `built` can serve work planned as `wanted` exactly as an engine built for it
    would, only perhaps with fewer sequences at once: the same backend, model, cores and args, a context at least
    as long (None: the model's own limit), and no more sequences than the plan's KV budget holds (so it never
    preempts where the planned engine would not). A warm engine kept across jobs is reused only then."""
    if built is None:
        return False
    if (built.backend, built.model_path, built.served_model_name, built.cpus, built.api_key) != (
        wanted.backend,
        wanted.model_path,
        wanted.served_model_name,
        wanted.cpus,
        wanted.api_key,
    ):
        return False
    rest = lambda args: {k: v for k, v in args.items() if k not in _COVERING_ARGS}  # noqa: E731
    if rest(built.args) != rest(wanted.args):
        return False
    have_len, want_len = built.args.get("max_model_len"), wanted.args.get("max_model_len")
    if have_len is not None and (want_len is None or have_len < want_len):
        return False
    have_seqs, want_seqs = built.args.get("max_num_seqs"), wanted.args.get("max_num_seqs")
    return have_seqs == want_seqs or (
        have_seqs is not None and want_seqs is not None and have_seqs <= want_seqs
    )
