"""The vLLM backend: an in-process AsyncLLM behind vLLM's own OpenAI serving layer.

Response bodies are produced by the same serving objects `vllm serve` uses, built with vLLM's `init_app_state`
exactly as its batch runner does — so tools, response_format, logprobs, n, stop and seed behave as users know them.
Which serving object answers which route, and with which request model, is the route registry's
(`pipeline/endpoints`, `Endpoint.vllm`): chat and completions (`OpenAIServingChat`, `OpenAIServingCompletion`),
responses (`OpenAIServingResponses`), embeddings (`ServingEmbedding`), score and rerank (`ServingScores`). A route
whose serving object the model did not get (a generative model asked for embeddings, or the reverse) is answered
with an `unsupported_task` error naming the route and the model's task. That layer is internal vLLM API; the
coupling lives in this module and in the registry's import paths (the `cpu` and `cuda` extras pin the same vLLM
version).

The serving-layer options of `vllm serve` (--chat-template, --tool-call-parser, --enable-auto-tool-choice,
--reasoning-parser, --response-role, --generation-config, --override-generation-config) are set on the same
namespace `vllm serve` would parse, under their own names; the structured-outputs backend where vLLM's
--structured-outputs-config.backend puts it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

from pipeline.adapters import lora_slots
from pipeline.endpoints import ENDPOINTS, Endpoint, endpoint_for
from pipeline.engines.base import (
    Engine,
    EngineRequest,
    EngineResult,
    EngineSpec,
    EngineStats,
    error_code_for,
)
from pipeline.engines.fitting import FitTarget, KvCapacity, own_requests, per_sequence, prompt_counter
from pipeline.engines.vllm_lora_worker import EXTENSION as LORA_WORKER_EXTENSION
from pipeline.models import ResolvedModel
from pipeline.protocol import ErrorCode
from pipeline.topology import Topology

log = structlog.get_logger(__name__)

_OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"

# Our engine-arg names that are not vLLM fields and must not be set on its args namespace.
# (lora_modules is vLLM's name, but a {name: path} map here: set as vLLM's LoRAModulePath list by build_vllm_namespace;
# structured_outputs_backend is set where vLLM's --structured-outputs-config.backend puts it.)
_NOT_VLLM_ARGS = {"cpu_kvcache_space_gib", "extra", "lora_modules", "structured_outputs_backend"}

# vLLM's import-time notices that leave a user nothing to do. On vllm-cpu: "Triton is installed, but doesn't
# include CPU backend. Disabling Triton." (Triton arrives as a dependency of xgrammar; the CPU backend never uses
# it.) Set before vLLM is imported in this process: the driver (engine-arg names) and each engine actor.
for _notice_logger in ("vllm.triton_utils.importing",):
    logging.getLogger(_notice_logger).setLevel(logging.ERROR)


# The serving options of `vllm serve`, by their namespace names: reported in the manifest as in force.
SERVING_OPTIONS = (
    "runner",
    "chat_template",
    "tool_call_parser",
    "enable_auto_tool_choice",
    "reasoning_parser",
    "response_role",
    "generation_config",
    "override_generation_config",
)


def _error_result(
    custom_id: str, status_code: int, message: str, error_type: str, param: Any = None
) -> EngineResult:
    code = error_code_for(status_code, message)
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code.value}}
    return EngineResult(custom_id, status_code, body, code)


def _vllm_namespace(model_path: str, served_model_name: str) -> Any:
    """vLLM's own CLI namespace with its defaults: what `vllm serve --model ...` would parse."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    return parser.parse_args(["--model", model_path, "--served-model-name", served_model_name])


def _vllm_args(spec: EngineSpec) -> dict[str, Any]:
    """Our engine args as vLLM arg names and values (the `extra` escape hatch merged in)."""
    args = {k: v for k, v in spec.args.items() if k not in _NOT_VLLM_ARGS and v is not None}
    args.update(spec.args.get("extra") or {})
    return args


def _unknown_arg_error(name: str) -> ValueError:
    return ValueError(f"unknown vLLM engine arg {name!r} (engine.vllm.extra): use vLLM's Python arg names")


def build_vllm_namespace(spec: EngineSpec, adapter_dirs: dict[str, str] | None = None) -> Any:
    """vLLM's own CLI namespace for this engine (what `vllm serve --model ...` would parse), then our args.
    `adapter_dirs`: the LoRA adapters it serves, by name, as directories on this node (staged)."""
    ns = _vllm_namespace(spec.model_path, spec.served_model_name)
    for name, value in _vllm_args(spec).items():
        if not hasattr(ns, name):
            raise _unknown_arg_error(name)
        setattr(ns, name, value)
    if adapter_dirs:
        from vllm.entrypoints.openai.models.protocol import LoRAModulePath

        # As `vllm serve --lora-modules name=path` sets them: loaded as the serving layer starts (a bad adapter
        # fails the engine's start, which preflight's checks make unlikely), served under their names.
        ns.enable_lora = True
        ns.lora_modules = [
            LoRAModulePath(name=name, path=path, base_model_name=spec.served_model_name)
            for name, path in adapter_dirs.items()
        ]
        extra = spec.args.get("extra") or {}
        if "max_cpu_loras" not in extra:
            # vLLM keeps max_loras adapters in its CPU cache by default, so every swap of a slot read the adapter
            # from disk again; each cached adapter costs its file's size in host memory.
            ns.max_cpu_loras = max(len(adapter_dirs), ns.max_loras or 1)
        if "worker_extension_cls" not in extra:  # a user's own extension wins; loads are then not counted
            ns.worker_extension_cls = LORA_WORKER_EXTENSION
    backend = spec.args.get("structured_outputs_backend")
    if backend:
        # As vLLM's CLI sets --structured-outputs-config.backend: a StructuredOutputsConfig with that backend
        # (replaced, so vLLM's own validation of the config runs).
        ns.structured_outputs_config = dataclasses.replace(ns.structured_outputs_config, backend=backend)
    # Stats on: the engine's own numbers (KV usage, preemptions, prefix hits) are part of the product.
    ns.disable_log_stats = False
    if getattr(ns, "reasoning_parser", None):
        # Where the serving layer reads it (vLLM's engine args copy it there as the engine is built; set it here
        # too, so the serving objects see it whatever the order).
        ns.structured_outputs_config.reasoning_parser = ns.reasoning_parser
    return ns


def _import(path: str) -> Any:
    module, name = path.split(":")
    import importlib

    return getattr(importlib.import_module(module), name)


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, read from package metadata (importing vLLM takes seconds)."""
    from importlib import metadata

    for distribution in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(distribution)
    return None


def vllm_arg_names(version: str) -> frozenset[str]:
    """Every engine arg name the installed vLLM accepts, cached per vLLM version under $NIGHTSHIFT_HOME.

    Checking a job's engine args needs only the names, but getting them means importing vLLM and building its
    argument parser (5-10 s on a small CPU box) on the driver, before any work starts. The names are fixed for a
    given vLLM version, so that cost is paid once per machine and version, not once per job.
    """
    from pipeline.local_files import atomic_write_json, nightshift_home

    cache = nightshift_home() / "cache" / f"vllm-{re.sub(r'[^A-Za-z0-9._+-]', '_', version)}-args.json"
    with contextlib.suppress(OSError, ValueError):
        return frozenset(json.loads(cache.read_text()))
    names = sorted(vars(_vllm_namespace("unused", "unused")))
    with contextlib.suppress(OSError):  # a read-only home only costs the next job the same seconds
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(cache, names)
    return frozenset(names)


def _check_against_model(spec: EngineSpec) -> None:
    """What vLLM would refuse only once an engine starts, refused here from the model's config.json: a topology
    the model cannot be sharded into (naming the sizes it takes) and a context longer than it allows. A model
    whose config cannot be read here is left to vLLM to judge."""
    from pipeline.model_shape import PlanError, read_config, shape_from_config
    from pipeline.topology import Topology, check_topology

    try:
        shape = shape_from_config(read_config(spec.model_path))
    except (PlanError, OSError):
        return
    check_topology(shape, Topology.of(spec.args), spec.served_model_name)
    asked = spec.args.get("max_model_len")
    if asked and int(asked) > shape.max_model_len_limit:
        raise ValueError(
            f"{spec.served_model_name}: max_model_len {asked} is longer than this model allows "
            f"({shape.max_model_len_limit} tokens); give it at most that (a pool serving it: its "
            "engine_overrides: {max_model_len: N})"
        )


class VllmEngine(Engine):
    computes_on_cpu_cores = True  # vllm-cpu: the engine's compute threads are bound to cores of their own
    reads_adapter_files = True

    @classmethod
    def check_spec(cls, spec: EngineSpec) -> None:
        version = installed_vllm_version()
        if version is None:
            raise ValueError(
                "the vllm engine is not installed: pip install 'nightshift-batch[cpu]' (CPU boxes) "
                "or 'nightshift-batch[cuda]' (NVIDIA GPUs)"
            )
        known = vllm_arg_names(version)
        for name in _vllm_args(spec):
            if name not in known:
                raise _unknown_arg_error(name)

        template = spec.args.get("chat_template")
        if template:
            from pipeline.tokens import load_chat_template

            load_chat_template(template)  # raises ValueError naming the file that is not there
        _check_against_model(spec)

    @classmethod
    def media_tokens(cls, model: ResolvedModel, args: dict[str, Any]) -> dict[str, int]:
        model_dir = _model_dir(model)
        if not model_dir:
            return {}
        try:
            return media_tokens(model_dir, args)
        except Exception as exc:  # noqa: BLE001 - a model vLLM's processor cannot be built for here
            # Its text is still counted; its images are not, and the engine (which does build the processor, or
            # refuses the model) answers for them.
            log.warning("media tokens not counted: vLLM's processor for the model failed", model=model_dir,
                        error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            return {}

    @classmethod
    def preload(cls) -> None:
        import vllm.entrypoints.launchers.api_server.app_state  # noqa: F401 - the serving layer start() builds
        import vllm.entrypoints.launchers.api_server.entry  # noqa: F401
        import vllm.entrypoints.launchers.cli_args  # noqa: F401

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self._stack = contextlib.AsyncExitStack()
        self._client: Any = None
        self._handlers: dict[str, Any] = {}  # endpoint name -> the serving callable, None when not served
        self._request_types: dict[str, Any] = {}  # endpoint name -> TypeAdapter of vLLM's request model
        self.task: str | None = None  # the task the engine runs the model for
        self._namespace: Any = None
        self._cores: list[int] | None = None  # the cores a CPU engine computes on
        # LoRA: the workers' adapter loads (vllm_lora_worker.py), read after adapter requests; None: not counted.
        self._adapter_loads: int | None = None
        self._loads_at_start = 0  # vLLM's serving layer loads every adapter as it starts: not the work's
        self._adapter_requests_inside = 0
        self._loads_read_at = 0.0

    async def start(self) -> None:
        from vllm.platforms import current_platform

        topology = Topology.of(self.spec.args)
        if current_platform.is_cpu():
            # Read by the engine-core subprocess at start; whole GiB only.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.spec.args.get("cpu_kvcache_space_gib") or 2))
            if self.spec.args.get("enforce_eager") is None:
                # vLLM's CPU runner warms a model up (and so sizes the tensors a later pipeline stage receives)
                # only when it compiles: an eager engine of several stages fails its first request ("assert
                # self.intermediate_tensors is not None"). Compiling costs tens of seconds, so only then.
                self.spec.args["enforce_eager"] = topology.pipeline_parallel_size == 1
            elif self.spec.args["enforce_eager"] and topology.pipeline_parallel_size > 1:
                raise ValueError(
                    "enforce_eager with pipeline_parallel_size > 1 fails on vLLM's CPU backend (a later stage is "
                    "never warmed up): leave enforce_eager unset for this pool"
                )
        from pipeline.engines.vllm_media import use_media_policy

        use_media_policy(self.spec.media)  # every media URL vLLM would fetch goes through the job's policy
        if topology.sharded and not self.spec.args.get("distributed_executor_backend"):
            # vLLM would pick its Ray executor inside a placement group, which its CPU backend does not have:
            # see topology.EngineGroup for which executor runs where.
            self.spec.args["distributed_executor_backend"] = "mp" if current_platform.is_cpu() else "ray"

        from pydantic import TypeAdapter
        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
        from vllm.usage.usage_lib import UsageContext

        # The adapters as the runtime staged them on this node (remote ones copied here once).
        ns = build_vllm_namespace(self.spec, self.spec.adapter_dirs)
        validate_parsed_serve_args(ns)  # what `vllm serve` refuses before loading anything
        with self._cpu_cores_env():  # read by the engine-core process as it starts
            self._client = await self._stack.enter_async_context(
                build_async_engine_client(ns, usage_context=UsageContext.OPENAI_BATCH_RUNNER)
            )
        if getattr(ns, "worker_extension_cls", None) == LORA_WORKER_EXTENSION:
            # Before the serving layer loads the adapters: their first loads count too.
            await self._client.collective_rpc("nightshift_lora_install", args=(current_platform.is_cpu(),))
            self._adapter_loads = 0
        tasks = await self._client.get_supported_tasks()
        state = State()
        await init_app_state(self._client, state, ns, tasks)
        if self._adapter_loads is not None:
            # Counted from here on: the loads routing can save are those the work makes.
            await self._read_adapter_loads()
            self._loads_at_start, self._adapter_loads = self._adapter_loads or 0, 0
        self._namespace = ns
        self.task = _engine_task(self._client.model_config, tasks)
        for endpoint in ENDPOINTS:
            serving = getattr(state, endpoint.vllm.serving, None)
            if serving is not None and endpoint.vllm.method:
                serving = getattr(serving, endpoint.vllm.method)
            if serving is not None and endpoint.vllm.file_url:
                domains = getattr(ns, "allowed_media_domains", None)
                serving = _with_fetched_file(serving, _import(endpoint.vllm.file_url), domains)
            self._handlers[endpoint.name] = serving
            if serving is not None:
                self._request_types[endpoint.name] = TypeAdapter(_import(endpoint.vllm.request))
        served = [name for name, handler in self._handlers.items() if handler is not None]
        log.info(
            "vllm engine ready",
            model=self.spec.served_model_name,
            task=self.task,
            routes=served,
            **self._kv_summary(),
        )

    @contextlib.contextmanager
    def _cpu_cores_env(self) -> Iterator[None]:
        """Bind a CPU engine's compute threads to the cores the runtime claimed for it, while it starts (vLLM's own
        binding would put every engine of a node on the same first cores; see cluster/cpu_cores.py).

        A bind the user set (`VLLM_CPU_OMP_THREADS_BIND` in the actor's environment) is theirs and kept; without
        claimed cores, vLLM binds as it would on its own.
        """
        cores = self.spec.cpu_cores
        if not _on_cpu() or _OMP_BIND in os.environ or not cores:
            if _on_cpu() and not cores:
                log.info("cpu engine left to vLLM's own core binding", cpus=self.spec.cpus)
            yield
            return
        self._cores = list(cores)
        ranks = Topology.of(self.spec.args).world
        log.info("cpu engine bound to its own cores", cores=self._cores, ranks=ranks)
        os.environ[_OMP_BIND] = omp_bind(self._cores, ranks)
        try:
            yield
        finally:
            del os.environ[_OMP_BIND]

    @classmethod
    def is_engine_dead(cls, exc: BaseException) -> bool:
        from vllm.v1.engine.exceptions import EngineDeadError

        return isinstance(exc, EngineDeadError)

    def _unsupported(self, custom_id: str, endpoint: Endpoint, url: str) -> EngineResult:
        message = (
            f"model {self.spec.served_model_name!r} runs the {self.task!r} task, which cannot serve {url}; it "
            f"serves {', '.join(u for e in ENDPOINTS if self._handlers.get(e.name) for u in e.urls)}"
        )
        body = {
            "error": {
                "message": message,
                "type": "BadRequestError",
                "param": None,
                "code": ErrorCode.UNSUPPORTED_TASK.value,
            }
        }
        return EngineResult(custom_id, 400, body, ErrorCode.UNSUPPORTED_TASK)

    async def generate(self, request: EngineRequest) -> EngineResult:
        if self._adapter_loads is None or request.body.get("model") == self.spec.served_model_name:
            return await self._generate(request)
        self._adapter_requests_inside += 1
        try:
            return await self._generate(request)
        finally:
            self._adapter_requests_inside -= 1
            # Read after the last adapter request in flight (so the count is complete when the work is), and at
            # most every second while they run.
            if self._adapter_requests_inside == 0 or time.monotonic() - self._loads_read_at > 1.0:
                await self._read_adapter_loads()

    async def _read_adapter_loads(self) -> None:
        self._loads_read_at = time.monotonic()
        with contextlib.suppress(Exception):  # a number, not the work: a failed read keeps the last one
            per_rank = await self._client.collective_rpc("nightshift_lora_stats")
            loads = max((rank.get("slot_loads", 0) for rank in per_rank), default=0)
            self._adapter_loads = loads - self._loads_at_start

    async def _generate(self, request: EngineRequest) -> EngineResult:
        from pydantic import ValidationError
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
        from vllm.v1.engine.exceptions import EngineDeadError

        endpoint = endpoint_for(request.url)
        if endpoint is None:  # validation lets no such line through; a stale work list could
            return _error_result(
                request.custom_id, 404, f"url {request.url!r} is not served", "NotFoundError"
            )
        handler = self._handlers.get(endpoint.name)
        if handler is None:
            return self._unsupported(request.custom_id, endpoint, request.url)
        try:
            parsed = self._request_types[endpoint.name].validate_python(request.body)
            response = await handler(parsed)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return _error_result(request.custom_id, 400, f"{where}: {first['msg']}", "BadRequestError")
        except EngineDeadError:
            raise  # the engine is gone: the runtime must replace it, not record an error per request
        except Exception as exc:  # noqa: BLE001 - one bad request must never take the batch down
            # vLLM's server maps its exceptions to HTTP errors this way (a request model's own validator raises
            # VLLMValidationError, not a pydantic error: 400, as `vllm serve` answers it).
            err = create_error_response(exc).error
            return _error_result(request.custom_id, int(err.code), err.message, err.type, err.param)

        if isinstance(response, ErrorResponse):
            err = response.error
            return _error_result(request.custom_id, int(err.code), err.message, err.type, err.param)
        body = _body(response)
        if body is None:
            # A stream (validation refuses stream=true and binary encodings, so only a body it let through by
            # mistake gets here). Closing a generator aborts the request inside the engine.
            with contextlib.suppress(Exception):
                await response.aclose()
            return _error_result(
                request.custom_id, 400, "streamed responses are not supported in a batch", "BadRequestError"
            )
        if isinstance(body, dict) and "error" in body and not endpoint.answers(body):
            err = body["error"] if isinstance(body["error"], dict) else {"message": str(body["error"])}
            return _error_result(
                request.custom_id,
                int(err.get("code") or 500) if str(err.get("code", "")).isdigit() else 500,
                str(err.get("message")),
                str(err.get("type") or "InternalServerError"),
                err.get("param"),
            )
        prompt_tokens, completion_tokens = endpoint.usage(body)
        return EngineResult(request.custom_id, 200, body, None, prompt_tokens, completion_tokens)

    def _kv_summary(self) -> dict[str, Any]:
        cache = self._client.vllm_config.cache_config
        blocks = cache.num_gpu_blocks or 0
        return {
            "kv_blocks": blocks,
            "block_size": cache.block_size,
            "kv_cache_tokens": blocks * cache.block_size,
        }

    def effective_args(self) -> dict[str, Any]:
        cfg = self._client.vllm_config
        return {
            "max_model_len": cfg.model_config.max_model_len,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
            "enable_prefix_caching": bool(cfg.cache_config.enable_prefix_caching),
            "gpu_memory_utilization": cfg.cache_config.gpu_memory_utilization,
            "enforce_eager": cfg.model_config.enforce_eager,
            "tensor_parallel_size": cfg.parallel_config.tensor_parallel_size,
            "pipeline_parallel_size": cfg.parallel_config.pipeline_parallel_size,
            "distributed_executor_backend": str(cfg.parallel_config.distributed_executor_backend),
            "seed": cfg.model_config.seed,
            "structured_outputs_backend": cfg.structured_outputs_config.backend,
            "task": self.task,
            **self._lora_summary(),
            **{name: _jsonable(getattr(self._namespace, name, None)) for name in SERVING_OPTIONS},
            **({"cpu_kvcache_space_gib": self.spec.args.get("cpu_kvcache_space_gib")} if _on_cpu() else {}),
            **self._kv_summary(),
            **(self.spec.args.get("extra") or {}),
        }

    def _lora_summary(self) -> dict[str, Any]:
        lora = self._client.vllm_config.lora_config
        if lora is None:
            return {}
        return {
            "lora_modules": dict(self.spec.args.get("lora_modules") or {}),
            "max_loras": lora.max_loras,
            "max_lora_rank": lora.max_lora_rank,
        }

    def sampling_defaults(self) -> dict[str, Any]:
        return dict(self._client.model_config.get_diff_sampling_param())

    def stats(self) -> EngineStats:
        from vllm.v1.metrics.reader import Counter, Gauge, get_metrics_snapshot

        values: dict[str, float] = {}
        for metric in get_metrics_snapshot():
            if isinstance(metric, Counter | Gauge):
                values[metric.name] = values.get(metric.name, 0) + metric.value
        return EngineStats(
            kv_cache_tokens=self._kv_summary()["kv_cache_tokens"],
            kv_cache_usage=values.get("vllm:kv_cache_usage_perc"),
            num_preemptions=int(values.get("vllm:num_preemptions", 0)),
            prefix_cache_queries=int(values.get("vllm:prefix_cache_queries", 0)),
            prefix_cache_hits=int(values.get("vllm:prefix_cache_hits", 0)),
            extra={"cpu_cores": self._cores} if self._cores is not None else {},
            adapter_loads=self._adapter_loads,
        )

    async def stop(self) -> None:
        await self._stack.aclose()

    def shutdown(self) -> None:
        # Without this the engine-core subprocess outlives a retired actor and keeps its memory.
        if self._client is not None:
            self._client.shutdown()


def _engine_task(model_config: Any, tasks: tuple[str, ...]) -> str | None:
    """The task the engine runs its model for, as pipeline.models.model_task names it from the files."""
    if "generate" in tasks:
        return "generate"
    if "transcription" in tasks:  # a speech-to-text-only model (Whisper)
        return "transcription"
    return model_config.get_pooling_task(tasks)


def _with_fetched_file(method: Any, request_model: Any, allowed_domains: list[str] | None = None) -> Any:
    """A speech-to-text serving method, called as run-batch calls it for a line with `file_url`: the file fetched
    (here under the job's media policy: vllm_media.fetch_file), then the method given its bytes and the request
    without `file_url`."""
    from io import BytesIO

    from starlette.datastructures import UploadFile

    from pipeline.engines.vllm_media import fetch_file

    decodes = importlib.util.find_spec("soundfile") is not None

    async def call(batch_request: Any) -> Any:
        if not decodes:  # vLLM would say only "Invalid or unsupported audio file"
            raise ValueError(
                "decoding audio needs the soundfile package: pip install 'nightshift-batch[audio]'"
            )
        data = await fetch_file(batch_request.file_url, allowed_domains)
        fields = batch_request.model_dump(exclude={"file_url"})
        fields["file"] = UploadFile(file=BytesIO(data), filename="audio.bin")
        return await method(data, request_model.model_validate(fields))

    return call


def _body(response: Any) -> Any:
    """The JSON body `vllm serve` would send for a serving object's answer: a pydantic response rendered as the
    API server's JSONResponse(content=response.model_dump()) renders it, or the JSON a pooling serving object
    already rendered. None for a stream."""
    if hasattr(response, "model_dump_json"):
        return json.loads(response.model_dump_json())
    media = getattr(response, "media_type", None)
    if hasattr(response, "body") and media in ("application/json", None):
        return json.loads(bytes(response.body))
    return None


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def omp_bind(cores: list[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for an engine of `ranks` ranks on these cores: an equal run of cores per rank,
    in rank order, ranks apart by "|" (vLLM asserts one core list per rank of the node)."""
    if ranks < 1 or len(cores) < ranks or len(cores) % ranks:
        raise ValueError(f"{len(cores)} cores cannot be shared out over {ranks} ranks")
    per_rank = len(cores) // ranks
    return "|".join(",".join(str(c) for c in cores[i * per_rank : (i + 1) * per_rank]) for i in range(ranks))


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# --- fitting (engines/fitting.py): what the driver and the ingest tasks can know before an engine starts --------

# config.json keys of a model with a vision or audio tower beside its language model, and the files of its processor.
_MEDIA_CONFIG_KEYS = ("vision_config", "audio_config", "vision_tower", "mm_vision_tower", "visual")
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


# Engine args that change what vLLM's processor makes of a media item (and so the tokens it takes).
_MEDIA_ARGS = ("trust_remote_code", "mm_processor_kwargs", "hf_overrides", "limit_mm_per_prompt")


def media_tokens(model_dir: str, args: dict[str, Any] | None = None) -> dict[str, int]:
    """Prompt tokens one media item takes in this model's prompts, by modality: its placeholder (the item's tokens
    and the markers around them) at the largest size the model's processor makes, as vLLM's own processor builds it
    for its memory profiling. What fitting and `validate` count for each image or audio part ({} for a model that
    takes no media): an upper bound where the size varies with the image, exact where it does not.

    Building vLLM's processor means importing vLLM (seconds), so only a directory that looks multimodal asks, and
    the answer is remembered under $NIGHTSHIFT_HOME per directory and vLLM version."""
    directory = Path(model_dir)
    if not _looks_multimodal(directory):
        return {}
    from pipeline.local_files import atomic_write_json, exclusive_lock, nightshift_home
    from pipeline.tokens import directory_stamp

    given = {**(args or {}), **((args or {}).get("extra") or {})}
    options = {name: given[name] for name in _MEDIA_ARGS if given.get(name) is not None}
    stamp = json.loads(
        json.dumps([installed_vllm_version(), directory_stamp(directory), options], default=str)
    )
    memo = nightshift_home() / "cache" / "media-tokens.json"
    key = f"{directory}\0{json.dumps(options, sort_keys=True, default=str)}"
    remembered = _remembered_media_tokens(memo).get(key)
    if isinstance(remembered, dict) and remembered.get("stamp") == stamp:
        tokens = remembered.get("tokens")
        if isinstance(tokens, dict) and all(isinstance(n, int) for n in tokens.values()):
            return {str(kind): n for kind, n in tokens.items()}
    tokens = _media_tokens_from_vllm(model_dir, options)
    with contextlib.suppress(OSError):  # a read-only home only costs the next job the same seconds
        memo.parent.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(memo.with_suffix(".lock")):
            known = _remembered_media_tokens(memo)
            known[key] = {"stamp": stamp, "tokens": tokens}
            atomic_write_json(memo, known)
    return tokens


def _remembered_media_tokens(memo: Path) -> dict[str, Any]:
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}  # a file damaged by hand is started again


def _looks_multimodal(directory: Path) -> bool:
    if any((directory / name).is_file() for name in _PROCESSOR_FILES):
        return True
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and any(key in config for key in _MEDIA_CONFIG_KEYS)


def _media_tokens_from_vllm(model_dir: str, options: dict[str, Any]) -> dict[str, int]:
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    config = ModelConfig(model=model_dir, **options)
    if not config.is_multimodal_model:
        return {}
    processor = MULTIMODAL_REGISTRY.create_processor(config)
    counts = {modality: 1 for modality, limit in processor.info.allowed_mm_limits.items() if limit}
    dummy = processor.get_dummy_mm_inputs(counts, cache=None)
    return {
        modality: max(item.length for item in items)
        for modality, items in dummy["mm_placeholders"].items()
        if items
    }


def fit_target(model: ResolvedModel, args: dict[str, Any], default_max_tokens: int) -> FitTarget | str:
    """vLLM's fit strategy: prompts counted with the model's tokenizer and chat template; the KV capacity from the
    model config on CPU, or from num_gpu_blocks_override (on GPUs the capacity is known only once an engine has
    measured its memory); the output budget vLLM would allow. `args`: the job's engine.vllm."""
    from pipeline.max_tokens import generation_max_tokens, output_budget
    from pipeline.model_shape import PlanError, model_shape
    from pipeline.planner import DeviceBudget, default_block_size, max_sequences, plan_pool
    from pipeline.tokens import load_chat_template

    model_dir = _model_dir(model)
    if model_dir is None:
        return f"model {model.path!r} is not a local directory or in the local Hugging Face cache"
    try:
        shape = model_shape(model_dir)
    except PlanError as exc:
        return f"cannot read the model's shape: {exc}"
    chat_template = args.get("chat_template")
    try:
        load_chat_template(chat_template)
    except ValueError as exc:  # a --chat-template that names no file: the engine would refuse it as well
        return str(exc)
    if importlib.util.find_spec("transformers") is None:
        return "measuring requests needs the model's tokenizer: pip install 'nightshift-batch[model]'"
    generation_default = generation_max_tokens(
        model_dir, args.get("generation_config", "auto"), args.get("override_generation_config")
    )

    def block_size(args: dict, device: str) -> int:
        extra = args.get("extra") or {}
        return int(extra.get("block_size") or default_block_size(device, shape.is_mla))

    def capacity(args: dict, device: str) -> KvCapacity | None:
        extra = args.get("extra") or {}
        block = block_size(args, device)
        if extra.get("num_gpu_blocks_override"):
            blocks = int(extra["num_gpu_blocks_override"])
        elif device == "cpu":
            try:
                budget = DeviceBudget.cpu(int(args.get("cpu_kvcache_space_gib") or 2))
                blocks = plan_pool(
                    shape,
                    budget,
                    None,
                    block,
                    extra.get("kv_cache_dtype", "auto"),
                    topology=Topology.of(args),
                    lora=lora_slots(args),
                ).kv_blocks  # each rank has a KV space of its own
            except PlanError:
                return None
        else:
            return None  # GPU memory is known to the engine, not to the driver
        usable = max(0, blocks - 1)  # vLLM's block pool keeps one block as its null block
        return KvCapacity(usable, block, lambda context: max_sequences(shape, usable, context, block))

    media = "".join(f" + {n} tokens per {kind}" for kind, n in sorted(model.media_tokens.items()))
    return FitTarget(
        counted_by=f"{model.name} tokenizer + chat template{media}",
        # The tokenizer loads on the first count, once per process (`prompt_counter`): the driver, which only
        # decides, never loads it; each ingest worker loads it once, whatever the number of its tasks.
        count=per_sequence(
            own_requests(
                model,
                args,
                lambda requests: prompt_counter(
                    model_dir, chat_template, model.task, model.media_tokens
                ).count_batch(requests),
            )
        ),
        output_budget=lambda url, body: output_budget(url, body, generation_default, default_max_tokens),
        model_limit=shape.max_model_len_limit,
        block_size=block_size,
        capacity=capacity,
    )


def _model_dir(model: ResolvedModel) -> str | None:
    if model.source != "hub-id":
        return model.path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model.path, local_files_only=True)
    except Exception:  # noqa: BLE001 - hub errors vary by version; the cause is always "not cached"
        return None
