"""Job configuration: one pydantic model per concern, a description on every field.

The same models back the YAML job file (`--config job.yaml`) and the CLI flags (a flag wins over the file): a
field that is a flag says so in its annotation (`Flag`, pipeline/config_flags.py), and the commands build their
flags from these models. Engine-arg names and flag names are vLLM's own, so what users know from `vllm serve`
carries over.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from pipeline.adapters import (
    VLLM_LORA_RANKS,
    AdapterError,
    check_adapter_names,
    parse_lora_modules,
    smallest_lora_rank_at_least,
)
from pipeline.config_flags import ConfigError, Flag
from pipeline.datasets.spec import DatasetConfig
from pipeline.engines.base import BACKEND_NAMES, backend
from pipeline.media.policy import MediaPolicy
from pipeline.server_urls import endpoint_base


class UnreadableConfigFile(ConfigError):
    """A config file that is no readable text at all (a directory, not UTF-8, no permission); its cause, if any,
    is the read error itself."""


class _Strict(BaseModel):
    # A typo in a YAML key must fail loudly, not be ignored.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


def json_object_flag(text: str, flag: str) -> dict[str, Any]:
    """A flag that takes a JSON object, as vLLM's own flags of that kind do."""
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise ConfigError(
            f"{flag}: not valid JSON ({exc}); give an object, e.g. '{{\"temperature\": 0.5}}'"
        ) from exc
    if not isinstance(parsed, dict):
        raise ConfigError(f"{flag}: must be a JSON object, got {type(parsed).__name__}")
    return parsed


def gpu_hour_prices_flag(values: list[str], flag: str) -> dict[str, float]:
    """`--gpu-hour-price 2.5 --gpu-hour-price cuda=3` -> {"*": 2.5, "cuda": 3.0}; the parsing is cost.py's."""
    from pipeline.prices import parse_gpu_hour_prices

    try:
        return parse_gpu_hour_prices(values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def lora_modules_flag(values: list[str], flag: str) -> dict[str, str]:
    """`--lora-modules a=/path --lora-modules b=s3://x/b` -> {"a": "/path", "b": "s3://x/b"} (parsing: adapters.py)."""
    try:
        return parse_lora_modules(values, flag)
    except AdapterError as exc:
        raise ConfigError(str(exc)) from exc


# max_num_seqs when it is neither given nor fitted to the KV capacity (fitting off, or the capacity unknown).
DEFAULT_MAX_NUM_SEQS = 64


class VllmEngineArgs(_Strict):
    """Engine arguments passed to vLLM (names as in `vllm serve`).

    Unset (None) engine args are the ones `run` may fit to the data (see FitConfig); a value given in the config
    file or by a flag is always used as is.
    """

    max_model_len: Annotated[
        int | None, Flag("--max-model-len", "vLLM: context length. Default: fitted to the input (see --fit).")
    ] = Field(
        default=None,
        ge=16,
        description="Context length (prompt + output tokens). Default: fitted to the input (its longest prompt + "
        "max_tokens, rounded up to a KV block, at most the model's limit); without fitting, the model's own limit.",
    )
    max_num_seqs: Annotated[
        int | None,
        Flag(
            "--max-num-seqs",
            "vLLM: most sequences run at once. Default: what the KV cache holds (see --fit).",
        ),
    ] = Field(
        default=None,
        ge=1,
        description="Most sequences the engine runs at once. Default: as many as the KV cache holds at "
        f"max_model_len (on CPU at most 256; {DEFAULT_MAX_NUM_SEQS} when fitting is off); on a GPU, where the cache "
        "is measured only as the engine starts, vLLM's own choice, read back to size the in-flight window.",
    )
    gpu_memory_utilization: Annotated[
        float, Flag("--gpu-memory-utilization", "vLLM: share of GPU memory to use.")
    ] = Field(
        default=0.9, gt=0, le=1, description="Share of accelerator memory vLLM may use (weights + KV cache)."
    )
    dtype: Annotated[str, Flag("--dtype", "vLLM: dtype (auto, bfloat16, float16, float32).")] = Field(
        default="auto", description="Weight/activation dtype: auto, bfloat16, float16, float32."
    )
    enable_prefix_caching: Annotated[
        bool | None, Flag("--enable-prefix-caching/--no-enable-prefix-caching", "vLLM: prefix cache.")
    ] = Field(
        default=None,
        description="Reuse the KV cache of shared prompt prefixes (system prompts, few-shot blocks). Default: "
        "vLLM's — on for generative models, off for pooling models (an encoder such as MiniLM has no KV cache "
        "to share, and vLLM refuses to start one with it on).",
    )
    enforce_eager: Annotated[bool | None, Flag("--enforce-eager/--no-enforce-eager", "vLLM: no graphs.")] = (
        Field(
            default=None,
            description="Skip graph capture/compilation. Default: on for CPU engines (compilation costs minutes there).",
        )
    )
    tensor_parallel_size: Annotated[
        int,
        Flag(
            "--tensor-parallel-size",
            "vLLM: ranks (GPUs; CPU: core sets) that split every layer of one engine.",
        ),
    ] = Field(
        default=1,
        ge=1,
        description="Ranks one engine splits every layer across (vLLM's tensor parallelism): one GPU each, or on a "
        "CPU engine one set of its cores each. They share a node; the model's heads and MLP must divide by it "
        "(checked before any work, naming the values that do).",
    )
    pipeline_parallel_size: Annotated[
        int, Flag("--pipeline-parallel-size", "vLLM: stages one engine's layers are split into.")
    ] = Field(
        default=1,
        ge=1,
        description="Stages one engine's layers are split into (vLLM's pipeline parallelism), each of "
        "tensor_parallel_size ranks. On GPUs the stages may sit on different nodes (vLLM's Ray executor); a CPU "
        "engine keeps all its ranks on one node.",
    )
    seed: Annotated[int | None, Flag("--seed", "vLLM: engine seed.")] = Field(
        default=None, description="Engine-level random seed."
    )
    cpu_kvcache_space_gib: Annotated[int, Flag("--cpu-kvcache-space", "CPU engines: KV cache GiB.")] = Field(
        default=2, ge=1, description="CPU engines only: KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE)."
    )
    runner: Annotated[
        Literal["auto", "generate", "pooling"],
        Flag(
            "--runner", "vLLM: generate or pooling (embeddings, score, rerank). Default: auto, by the model."
        ),
    ] = Field(
        default="auto",
        description="vLLM's --runner: generate (chat, completions, responses) or pooling (embeddings, score, "
        "rerank). auto: decided by the model, as vLLM does (a Sentence Transformers model or a *Model / "
        "*ForSequenceClassification architecture pools, a *ForCausalLM generates).",
    )
    # The serving-layer options of `vllm serve` / run-batch, with vLLM's names and defaults.
    chat_template: Annotated[
        str | None,
        Flag(
            "--chat-template",
            "vLLM: chat template (Jinja text, a file, or one vLLM ships). Default: the model's.",
        ),
    ] = Field(
        default=None,
        description="vLLM's --chat-template: a Jinja template, a file holding one, or the name of one vLLM ships. "
        "Default: the model's own. A file must be readable where the engines run; it is also read (on the "
        "driver) to count prompt tokens.",
    )
    tool_call_parser: Annotated[
        str | None, Flag("--tool-call-parser", "vLLM: tool-call parser (hermes, llama3_json, mistral, ...).")
    ] = Field(
        default=None,
        description="vLLM's --tool-call-parser (e.g. hermes, llama3_json, mistral): parses tool calls out of "
        "the generated text. Needed for tool_choice 'required' or a named tool.",
    )
    enable_auto_tool_choice: Annotated[
        bool, Flag("--enable-auto-tool-choice", "vLLM: tool_choice 'auto' (needs --tool-call-parser).")
    ] = Field(
        default=False,
        description="vLLM's --enable-auto-tool-choice: let the model decide to call tools (tool_choice 'auto'); "
        "needs tool_call_parser.",
    )
    reasoning_parser: Annotated[
        str | None, Flag("--reasoning-parser", "vLLM: reasoning parser (deepseek_r1, qwen3, ...).")
    ] = Field(
        default=None,
        description="vLLM's --reasoning-parser (e.g. deepseek_r1, qwen3): splits reasoning from the answer into "
        "message.reasoning.",
    )
    structured_outputs_backend: Annotated[
        Literal["auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"],
        Flag(
            "--structured-outputs-backend",
            "vLLM: engine of response_format / structured_outputs (xgrammar, guidance, ...). Default: auto.",
        ),
    ] = Field(
        default="auto",
        description="vLLM's structured-outputs backend (its --structured-outputs-config.backend): the library that "
        "constrains generation to a request's response_format (json_object, json_schema) or structured_outputs "
        "(json, regex, choice, grammar). auto: vLLM picks per request (xgrammar, else guidance).",
    )
    response_role: Annotated[
        str, Flag("--response-role", "vLLM: role of generated chat messages. Default: assistant.")
    ] = Field(
        default="assistant",
        description="vLLM's --response-role: the role of generated chat messages when the request does not end "
        "with add_generation_prompt false.",
    )
    generation_config: Annotated[
        str,
        Flag(
            "--generation-config",
            "vLLM: sampling defaults from 'auto' (the model's), 'vllm', or a directory.",
        ),
    ] = Field(
        default="auto",
        description="vLLM's --generation-config: 'auto' (the model's generation_config.json sets the sampling "
        "defaults), 'vllm' (vLLM's neutral defaults), or a directory holding a generation_config.json.",
    )
    override_generation_config: Annotated[
        dict[str, Any],
        Flag(
            "--override-generation-config",
            "vLLM: sampling defaults over the generation config, as a JSON object.",
            parse=json_object_flag,
        ),
    ] = Field(
        default_factory=dict,
        description="vLLM's --override-generation-config: sampling defaults over the generation config, e.g. "
        "{temperature: 0.5, max_new_tokens: 128}. The effective defaults are in the manifest.",
    )
    lora_modules: Annotated[
        dict[str, str],
        Flag(
            "--lora-modules",
            "vLLM: a LoRA adapter as NAME=PATH (local dir, s3://, hf://ORG/NAME); repeat for more. Requests "
            "naming NAME run with it.",
            parse=lora_modules_flag,
            multiple=True,
        ),
    ] = Field(
        default_factory=dict,
        description="vLLM's --lora-modules: LoRA adapters of this model, {name: path}. A request whose `model` is "
        "a name here runs on this model with that adapter; the model itself stays servable. A path is a local "
        "directory (readable where the engines run), an s3:// prefix (staged once per node) or hf://ORG/NAME in "
        "the node's Hugging Face cache. Per pool: engine_overrides.lora_modules.",
    )
    max_loras: Annotated[
        int | None, Flag("--max-loras", "vLLM: adapters one engine holds at once (default 1).")
    ] = Field(
        default=None,
        ge=1,
        description="vLLM's --max-loras: adapters one engine holds at once; a request for another waits for a "
        "slot and swaps one out. Default: vLLM's (1). Routing keeps each adapter's rows on few engines.",
    )
    max_lora_rank: Annotated[
        int | None, Flag("--max-lora-rank", "vLLM: the highest adapter rank served (default 16).")
    ] = Field(
        default=None,
        ge=1,
        description="vLLM's --max-lora-rank: the highest rank of an adapter it serves (memory is reserved for "
        "it). Default: vLLM's (16). An adapter above it is refused before any work.",
    )
    limit_mm_per_prompt: Annotated[
        dict[str, Any] | None,
        Flag(
            "--limit-mm-per-prompt",
            "vLLM: most media items of each kind in one prompt, as a JSON object, e.g. '{\"image\": 2}'.",
            parse=json_object_flag,
        ),
    ] = Field(
        default=None,
        description="vLLM's --limit-mm-per-prompt: most items of each modality one prompt may carry, e.g. "
        "{image: 2, audio: 1}; a line with more is its invalid_request. Default: vLLM's (1 of each the model takes).",
    )
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="Any further vLLM engine args, by their Python name (e.g. {kv_cache_dtype: fp8}).",
    )

    @field_validator("max_lora_rank")
    @classmethod
    def _a_rank_vllm_takes(cls, value: int | None) -> int | None:
        if value is not None and value not in VLLM_LORA_RANKS:
            fits = smallest_lora_rank_at_least(value)
            raise ValueError(
                f"vLLM takes max_lora_rank {', '.join(map(str, VLLM_LORA_RANKS))}, not {value}"
                + (f": give {fits}" if fits else "")
            )
        return value

    @field_validator("lora_modules")
    @classmethod
    def _adapter_names(cls, value: dict[str, str]) -> dict[str, str]:
        check_adapter_names(value)  # AdapterError is a ValueError: pydantic reports it under the field
        return value

    @model_validator(mode="after")
    def _tool_choice_needs_parser(self) -> VllmEngineArgs:
        # vLLM refuses to start this way ("--enable-auto-tool-choice requires --tool-call-parser"): say it now.
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser)")
        return self


class FakeEngineArgs(_Strict):
    """The fake engine's token-time model, for data-plane tests and scale simulation."""

    prefill_seconds_per_token: float = Field(default=0.0, ge=0, description="Cost of one prompt token.")
    decode_seconds_per_token: float = Field(
        default=0.0, ge=0, description="Cost of one generated token per step."
    )
    max_concurrency: int = Field(
        default=256, ge=1, description="Sequences the fake engine runs at once (its KV limit)."
    )
    kv_cache_tokens: int | None = Field(
        default=None,
        ge=1,
        description="A simulated KV cache: when set, the engine decides its max_num_seqs as it starts "
        "(kv_cache_tokens // max_model_len), as vLLM does on a GPU from its measured memory, instead of using "
        "max_concurrency.",
    )
    output_tokens: int = Field(
        default=16, ge=1, description="Tokens generated when the request sets no max_tokens."
    )
    start_seconds: float = Field(
        default=0.0,
        ge=0,
        le=600,
        description="Time the engine takes to start (a real engine loads its model): what warm engines save.",
    )
    embedding_dimensions: int = Field(
        default=384,
        ge=1,
        description="Length of the fake embedding vectors when the request sets no dimensions.",
    )
    crash_on: list[str] = Field(
        default_factory=list,
        description="Failure injection: the engine process dies on a request whose custom_id contains one of these.",
    )
    hold_while: str | None = Field(
        default=None,
        description="Failure injection: while this file exists, a request waits before it runs (requests already "
        "running finish): lets a test stop the work at a point of its choosing, whatever the box's load.",
    )
    call_log: str | None = Field(
        default=None,
        description="Append every custom_id the engine runs to this file (counts recomputation); '{pid}' in the "
        "path is replaced by the engine process's id.",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="Ranks per stage of a sharded fake engine: like vLLM's Ray executor, one small Ray actor per "
        "rank in the engine's placement group, every request passing through all of them (engines/fake_ranks.py).",
    )
    pipeline_parallel_size: int = Field(
        default=1, ge=1, description="Stages of a sharded fake engine (see tensor_parallel_size)."
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="Adapters the fake engine serves by name, {name: path}: as vLLM's lora_modules, but nothing "
        "is read from the path (it is named in answers).",
    )
    max_loras: int = Field(
        default=1, ge=1, description="Adapters the fake engine holds at once (vLLM's max_loras); more swap."
    )
    adapter_load_seconds: float = Field(
        default=0.0,
        ge=0,
        description="Time to load an adapter into a free or swapped slot: what adapter-aware routing saves.",
    )


# Requests in flight per endpoint when neither given nor told by the server (llama.cpp's /props tells its slots).
DEFAULT_HTTP_CONCURRENCY = 64
# Ray CPUs an http engine actor reserves: it waits on the network, and the CPUs are ingest's and finalize's.
HTTP_CPUS_PER_ENGINE = 0.5
_ENDPOINT = re.compile(r"^https?://[^/\s]+(/\S*)?$")


class HttpEngineArgs(_Strict):
    """The http backend: each request POSTed to an OpenAI-compatible server (vllm serve, SGLang, llama.cpp's
    llama-server, Ollama, TGI). The servers' own engine args and sampling defaults apply."""

    endpoints: Annotated[
        list[str],
        Flag(
            "--endpoint",
            "http: an OpenAI-compatible server's base URL (repeat for several; one pool each, all pulling from one queue).",
        ),
    ] = Field(
        default_factory=list,
        description="Base URLs of the servers, e.g. http://10.0.0.5:8000 (a trailing /v1 is fine). Each endpoint "
        "is a pool of its own; all of them pull from the job's one work queue, so a faster server takes more.",
    )
    concurrency: Annotated[
        int | None,
        Flag(
            "--concurrency",
            "http: requests in flight per endpoint. Default: a llama.cpp server's slots, else 64.",
        ),
    ] = Field(
        default=None,
        ge=1,
        description="Requests in flight per endpoint. Default: the slots a llama.cpp server reports (/props), "
        f"else {DEFAULT_HTTP_CONCURRENCY}. Sending one request at a time leaves a batching server mostly idle.",
    )
    api_key: Annotated[
        SecretStr | None,
        Flag(
            "--api-key",
            "http: bearer token for the servers (never written to OUTPUT; default: $NIGHTSHIFT_API_KEY).",
        ),
    ] = Field(
        default=None,
        description="Bearer token sent to every endpoint. Never written to OUTPUT (neither the checkpoint nor "
        "the manifest): a resumed job reads it from the variable named by api_key_env.",
    )
    api_key_env: str | None = Field(
        default="NIGHTSHIFT_API_KEY",
        description="Environment variable (on the driver) holding the bearer token when api_key is not given.",
    )
    timeout_s: Annotated[
        float, Flag("--request-timeout", "http: seconds one response may take (default 600).")
    ] = Field(
        default=600.0, gt=0, description="Longest wait for one response (a long generation takes minutes)."
    )
    connect_timeout_s: float = Field(default=10.0, gt=0, description="Longest wait to connect to a server.")
    max_retries: int = Field(
        default=6,
        ge=0,
        le=50,
        description="Retries of one request after a 429, a 5xx, a timeout or a dropped connection, with "
        "exponential backoff and jitter (a Retry-After header wins). A 4xx other than 408/429 is the request's "
        "own fault: never retried, it becomes the request's error record.",
    )
    backoff_s: float = Field(
        default=0.5, ge=0, description="Delay before the first retry; doubles per retry."
    )
    backoff_max_s: float = Field(default=30.0, ge=0, description="Longest delay between two retries.")

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not _ENDPOINT.match(url):
                raise ValueError(f"{url!r} is not an http(s):// URL (e.g. http://127.0.0.1:8000)")
        if len({endpoint_base(u) for u in value}) != len(value):
            raise ValueError(f"endpoints given twice: {value}")
        return value

    @field_serializer("api_key", when_used="json")
    def _never_written(self, value: SecretStr | None) -> None:
        # The job spec is stored in OUTPUT/_staging/ (and maybe a shared bucket): a token must not travel there.
        return None


class FitConfig(_Strict):
    """Fitting engine args to the data before the engines start (`nightshift plan --input`, applied)."""

    enabled: Annotated[
        bool,
        Flag(
            "--fit/--no-fit",
            "Fit max_model_len to the input (longest prompt + max_tokens) and max_num_seqs to the KV cache, unless given; prompts too long for the model become error records. Default: on.",
        ),
    ] = Field(
        default=True,
        description="Measure every request (tokenizer + chat template) after validation; set max_model_len to the "
        "longest prompt + max_tokens and max_num_seqs to what the KV cache holds at that length, unless given; "
        "requests whose prompt cannot fit even at the model's limit become context_length_exceeded error records. "
        "--no-fit turns it off.",
    )
    early: Annotated[
        bool,
        Flag(
            "--early-fit/--no-early-fit",
            "Fitting a large input: engines start on args fitted to a sample spread over it and take requests while the rest is read; requests longer than the sample's fit wait for engines fitted to the whole input. Default: on.",
        ),
    ] = Field(
        default=True,
        description="With fitting on, an input larger than the sample (2,048 lines from 64 places in it) is not "
        "waited for: the engines start on args fitted to the sample's longest need x 1.25 and take requests "
        "while ingest reads the rest; a request that needs more is held back and runs, once the whole input is "
        "measured, on engines started again with the args fitted to all of it (manifest: engine.fitted.early). "
        "--no-early-fit fits the whole input before any engine gets a request.",
    )
    early_min_bytes: int = Field(
        default=32 << 20,
        ge=0,
        description="The early fit applies to inputs of at least this many bytes (or of unknown size). A smaller "
        "input is read and fitted whole in seconds, and a request held back would cost its engines a second "
        "start: it is fitted exactly first.",
    )
    default_max_tokens: Annotated[
        int,
        Flag(
            "--default-max-tokens",
            "Fitting: output tokens budgeted for chat requests without max_tokens (default 256).",
        ),
    ] = Field(
        default=256,
        ge=1,
        description="Output tokens budgeted for a chat request that sets no max_tokens (when the model's "
        "generation_config sets no max_new_tokens either). vLLM lets such a request generate until the context "
        "ends, so with a fitted max_model_len its output may be cut there (reported in the manifest).",
    )


# Engine args named after vLLM's flags (so they live in engine.vllm) that other backends' blocks take too: given for
# such a backend, they are its own (`EngineConfig.args`); given for one without them, they are refused.
SHARED_WITH_VLLM = ("tensor_parallel_size", "pipeline_parallel_size", "lora_modules", "max_loras")


class EngineConfig(_Strict):
    """Which engine backend runs the requests, and how."""

    backend: Annotated[
        Literal[BACKEND_NAMES],
        Flag("--engine", "Engine backend: vllm (in-process), http (OpenAI-compatible servers) or fake."),
    ] = Field(  # type: ignore[valid-type] - the registry's names
        default="vllm",
        description="Engine backend behind the engine seam: vllm (in-process), http (OpenAI-compatible "
        "servers) or fake (deterministic, for tests). See pipeline/engines/base.py BACKENDS.",
    )
    vllm: VllmEngineArgs = Field(
        default_factory=VllmEngineArgs, description="Arguments for the vLLM backend."
    )
    http: HttpEngineArgs = Field(
        default_factory=HttpEngineArgs, description="Arguments for the http backend (servers, concurrency)."
    )
    fake: FakeEngineArgs = Field(
        default_factory=FakeEngineArgs, description="Arguments for the fake backend."
    )
    fit: FitConfig = Field(
        default_factory=FitConfig, description="Fitting max_model_len / max_num_seqs to the data."
    )
    max_in_flight: Annotated[int | None, Flag("--max-in-flight", "Requests kept in flight per engine.")] = (
        Field(
            default=None,
            ge=1,
            description="Requests each engine keeps in flight. Default: 2 x max_num_seqs, so continuous batching stays full.",
        )
    )
    warm_engines: str | None = Field(
        default=None,
        description="Take engines from this warm-engine keeper (a named Ray actor of a long-lived coordinator, "
        "e.g. the Batch API server: runtime/engines/warm_keeper.py) instead of starting them for this job; when it cannot be "
        "found, the job starts its own.",
    )

    def args(self) -> BaseModel:
        """This job's backend's own block (engine.vllm, engine.http or engine.fake), with the vLLM-named args given
        that it takes too (`SHARED_WITH_VLLM`)."""
        own = getattr(self, self.backend)
        shared = {k: v for k, v in self._shared_given().items() if k in type(own).model_fields}
        return own.model_copy(update=shared) if shared and own is not self.vllm else own

    def _shared_given(self) -> dict[str, Any]:
        """The args of SHARED_WITH_VLLM given in engine.vllm (not left at their defaults)."""
        given = {}
        for name in SHARED_WITH_VLLM:
            value = getattr(self.vllm, name)
            if value != VllmEngineArgs.model_fields[name].get_default(call_default_factory=True):
                given[name] = value
        return given

    def unused_settings(self) -> list[str]:
        """Settings given for a backend this job does not run: silently ignored, they would mislead (a config
        file's `fake:` block without `backend: fake` runs the real engine). The vllm block also holds the flags
        fitting reads (--max-model-len), so it is only unused where nothing is fitted."""
        unused = []
        for name in BACKEND_NAMES:
            block = getattr(self, name)
            if name == self.backend or block == type(block)():
                continue
            if name == "vllm" and backend(self.backend).fitting is not None:
                continue
            unused.append(
                f"engine.{name} is set but the backend is {self.backend}: it is not used "
                f"(set engine.backend: {name}, or --engine {name}, to run the {name} engine)"
            )
        return unused

    @model_validator(mode="after")
    def _shared_args_apply_or_are_refused(self) -> EngineConfig:
        # --tensor-parallel-size, --lora-modules, ... are vLLM's flags and land in engine.vllm; another backend that
        # takes the same arg takes them (its topology is the pool's, whatever the backend), one that does not
        # refuses them here, by name, rather than run without them.
        own = getattr(self, self.backend)
        if own is self.vllm:
            return self
        for name, value in self._shared_given().items():
            flag = f"--{name.replace('_', '-')} (engine.vllm.{name})"
            if name not in type(own).model_fields:
                raise ValueError(
                    f"{flag} is not read by the {self.backend} backend: drop it, or run --engine vllm"
                )
            mine = getattr(own, name)
            if name in own.model_fields_set and mine != value:
                raise ValueError(
                    f"{flag} is {value!r} but engine.{self.backend}.{name} is {mine!r}: give one of them"
                )
        return self

    @model_validator(mode="after")
    def _http_needs_endpoints(self) -> EngineConfig:
        if self.backend == "http" and not self.http.endpoints:
            raise ValueError(
                "the http backend needs at least one server: --endpoint URL (engine.http.endpoints)"
            )
        return self


class EngineResources(_Strict):
    """The Ray resources each engine actor reserves: the job's `resources` and each of its `pools` take them."""

    cpus_per_engine: Annotated[
        float | None,
        Flag(
            "--cpus-per-engine",
            "Ray CPUs reserved per engine actor; a CPU engine computes on that many cores of its own. "
            "Default: 1 on GPUs; a CPU engine takes its node's cores (shared among the engines there).",
        ),
    ] = Field(
        default=None,
        ge=0,
        description="Ray CPUs reserved per engine actor. A CPU engine computes on that many whole cores of its "
        "own (claimed per node; vLLM's VLLM_CPU_OMP_THREADS_BIND, when set, wins). Default: an engine on GPUs 1; "
        "a CPU engine the cores of the node it runs on, shared out among the engines placed on it (one engine on "
        "all cores measured faster than one per core: bench/shared_prefix.py).",
    )
    gpus_per_engine: Annotated[float, Flag("--gpus-per-engine", "Ray GPUs reserved per engine actor.")] = (
        Field(default=0.0, ge=0, description="Ray GPUs reserved per engine actor.")
    )
    resources_per_engine: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per engine actor, e.g. {'accelerator:rocm': 1} (`nightshift node start` "
        "gives each node its accelerator:* resource).",
    )


class ResourcesConfig(EngineResources):
    """Where engine actors run on the Ray cluster."""

    address: Annotated[str | None, Flag("--address", "Ray cluster address; default: start a local Ray.")] = (
        Field(default=None, description="Ray address to join; default: start a local Ray.")
    )
    num_engines: Annotated[int | None, Flag("--num-engines", "Engine actors (replicas).")] = Field(
        default=None,
        ge=1,
        description="Engine actors (replicas) in the pool. Default: 1 on GPUs; for CPU engines one per core of the "
        "nodes that can host them, as many as their memory holds (on a 2-core box two one-core engines measured "
        "faster than one engine on both cores: bench/shared_prefix.py).",
    )
    rows_per_task: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Rows handed to an engine actor at a time (one Ray Data batch, the unit of checkpointing). Default: "
            "sized to the engine — max_num_seqs for a real engine, so finished rows flow back steadily; larger "
            "chunks (up to 16384 rows, about 2 s of work each) for an engine whose speed is known up front."
        ),
    )


class RoutingConfig(_Strict):
    """How requests are spread over a pool's engines."""

    prefix_aware: Annotated[
        bool,
        Flag(
            "--prefix-routing/--no-prefix-routing",
            "Send requests sharing a long leading prompt to the same engine (default: on).",
        ),
    ] = Field(
        default=True,
        description=(
            "Send requests that share a long leading prompt (system prompt, few-shot block, tools) to the same "
            "engine, so its prefix cache pays: each engine of a fixed-size pool gets its own lane of work, and a "
            "lane that runs out of its own prompts takes others' rather than idle. Only jobs with such shared "
            "prompts are routed; the rest run exactly as without it."
        ),
    )


class PoolConfig(EngineResources):
    """An accelerator pool: engines that share one kind of hardware, with their own Ray resources and engine args.

    A job may span several pools (e.g. an NVIDIA pool and an AMD pool); all of them pull from one work queue.
    """

    name: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=40,
        description="Pool name (lowercase, digits, '-').",
    )
    min_engines: int = Field(default=1, ge=1, description="Engine actors the pool keeps.")
    max_engines: int | None = Field(
        default=None,
        ge=1,
        description="Engine actors the pool may grow to; default: min_engines (a fixed pool).",
    )
    accelerator_type: str | None = Field(
        default=None,
        description="Ray accelerator_type the engines need (e.g. H100, AMD-Instinct-MI300X-OAM).",
    )
    engine_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine args for this pool only, over the job's (e.g. {gpu_memory_utilization: 0.85}).",
    )
    model: str | None = Field(
        default=None,
        description="The model this pool's engines serve (a directory, a hub id, or embedded:NAME), e.g. an "
        "embedding model beside the job's chat model. Each request runs on a pool serving its body's `model`. "
        "Default: the job's model. The job's fitted max_model_len / max_num_seqs apply to the job's model only; "
        "a pool of another model runs with vLLM's defaults for it, or its engine_overrides.",
    )
    served_model_name: str | None = Field(
        default=None,
        description="The name requests use for this pool's model. Default: its `model` as given (embedded models: "
        "their own name).",
    )

    @property
    def device(self) -> Literal["cpu", "gpu"]:
        """Where the pool's engines compute: on GPUs when each reserves any, else on CPU cores."""
        return "gpu" if self.gpus_per_engine > 0 else "cpu"

    @model_validator(mode="after")
    def _bounds(self) -> PoolConfig:
        if self.max_engines is not None and self.max_engines < self.min_engines:
            raise ValueError(
                f"pool {self.name}: max_engines ({self.max_engines}) < min_engines ({self.min_engines})"
            )
        return self


class ObserveConfig(_Strict):
    """What the job shows of itself while it runs and leaves behind: metrics, the report, its cost."""

    metrics_port: Annotated[
        int | None,
        Flag("--metrics-port", "Serve Prometheus metrics of the running job on this port (/metrics)."),
    ] = Field(
        default=None,
        ge=1,
        le=65535,
        description="Serve Prometheus metrics of the running job on this port of the driver (/metrics).",
    )
    report: Annotated[
        bool, Flag("--report/--no-report", "Write report.html beside manifest.json (default: on).")
    ] = Field(default=True, description="Write report.html (charts, settings, cost) beside the manifest.")
    gpu_hour_price: Annotated[
        dict[str, float],
        Flag(
            "--gpu-hour-price",
            "Price of one accelerator-hour (CPU engines: one node-hour), e.g. 2.5, or per pool: cuda=2.5 (repeat). Gives the job's cost per 1M tokens.",
            parse=gpu_hour_prices_flag,
            multiple=True,
        ),
    ] = Field(
        default_factory=dict,
        description="Price of one accelerator-hour per pool (on CPU engines: one node-hour); key '*' for every "
        "pool. Gives the job's own cost per 1M tokens.",
    )
    hosted_price: Annotated[
        str | None,
        Flag(
            "--hosted-price",
            "Hosted batch price to compare with: INPUT/OUTPUT USD per 1M tokens (e.g. 0.075/0.30) or a preset (e.g. openai-gpt-4o-mini-batch; see pipeline/data/hosted_prices.yaml).",
        ),
    ] = Field(
        default=None,
        description="A hosted batch price to compare with: a preset (pipeline/data/hosted_prices.yaml, "
        "e.g. openai-gpt-4o-mini-batch) or INPUT/OUTPUT in USD per 1M tokens.",
    )

    @field_validator("gpu_hour_price")
    @classmethod
    def _prices(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in value.items() if v < 0}
        if bad:
            raise ValueError(f"prices must not be negative, got {bad}")
        return value

    @field_validator("hosted_price")
    @classmethod
    def _hosted(cls, value: str | None) -> str | None:
        if value is not None:
            from pipeline.prices import parse_hosted_price

            parse_hosted_price(value)
        return value


class OutputConfig(_Strict):
    """How results are written."""

    format: Annotated[
        Literal["jsonl", "parquet"] | None, Flag("--format", "Output format: jsonl or parquet.")
    ] = Field(
        default=None,
        description="Output file format: jsonl (OpenAI Batch lines) or parquet (custom_id, status_code, response, "
        "error, plus flattened content, finish_reason, prompt_tokens, completion_tokens). Default: jsonl; a dataset "
        "job's table comes back in its input's format.",
    )
    rows_per_shard: Annotated[int, Flag("--rows-per-shard", "Result rows per output shard.")] = Field(
        default=100_000, ge=1, description="Result rows per shard file (range-partitioned)."
    )
    staging_rows: int = Field(
        default=1024,
        ge=1,
        description="Finished rows buffered before a staged part is written (the checkpoint step).",
    )


class StorageConfig(_Strict):
    """How remote inputs and outputs (s3://, http(s)://) are reached.

    S3 credentials come from the usual AWS sources (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN,
    AWS_PROFILE, instance roles); the endpoint and region fall back to AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL and
    AWS_REGION / AWS_DEFAULT_REGION.
    """

    s3_endpoint_url: Annotated[
        str | None,
        Flag("--s3-endpoint-url", "S3-compatible endpoint. Default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL."),
    ] = Field(
        default=None,
        description="S3-compatible endpoint (MinIO, Ceph, R2, ...). Default: AWS_ENDPOINT_URL_S3 or "
        "AWS_ENDPOINT_URL, else AWS itself.",
    )
    s3_region: Annotated[str | None, Flag("--s3-region", "S3 region. Default: AWS_REGION.")] = Field(
        default=None, description="S3 region. Default: AWS_REGION or AWS_DEFAULT_REGION."
    )
    s3_anon: bool = Field(
        default=False, description="Unsigned S3 requests (public buckets); no credentials are used."
    )
    retries: Annotated[
        int, Flag("--io-retries", "Retries of a transient S3/HTTP error (with backoff) before failing.")
    ] = Field(
        default=4,
        ge=0,
        le=20,
        description="Retries of a transient storage error (connection refused or reset, timeout, HTTP 5xx/429, "
        "S3 throttling) before the job fails. Each retry is logged.",
    )
    retry_backoff_s: float = Field(
        default=0.5, ge=0, description="Delay before the first retry; doubles with each further retry."
    )
    retry_backoff_max_s: float = Field(default=20.0, ge=0, description="Longest delay between two retries.")
    timeout_s: float = Field(
        default=30.0, gt=0, description="Connect and read timeout of one storage request, in seconds."
    )
    http_max_download_bytes: int = Field(
        default=256 << 30,
        ge=1,
        description="Most bytes one http(s):// input file may download (it is held on local disk while read): a "
        "server that never stops sending cannot fill the disk.",
    )
    http_max_download_s: float = Field(
        default=6 * 3600.0,
        gt=0,
        description="Longest one http(s):// input file's download may take, retries included.",
    )
    http_headers: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="Extra headers on every HTTP(S) input/output request, e.g. {Authorization: Bearer ...}. "
        "Secrets: never written to OUTPUT (the checkpoint, the manifest) nor to a child job's file, and dropped "
        "when a server redirects to another origin; a resumed job reads them from the variable named by "
        "http_headers_env.",
    )
    http_headers_env: str | None = Field(
        default="NIGHTSHIFT_HTTP_HEADERS",
        description="Environment variable holding the headers as a JSON object, when http_headers is not given "
        "(a resumed job, a job file without secrets).",
    )

    @model_validator(mode="after")
    def _headers_from_the_environment(self) -> StorageConfig:
        if not self.http_headers and self.http_headers_env and os.environ.get(self.http_headers_env):
            try:
                given = json.loads(os.environ[self.http_headers_env])
            except ValueError as exc:
                raise ValueError(
                    f"${self.http_headers_env} is not a JSON object of header names and values"
                ) from exc
            if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
                raise ValueError(
                    f"${self.http_headers_env} must be a JSON object of header names and string values"
                )
            self.http_headers = {str(name): SecretStr(value) for name, value in given.items()}
        return self

    @field_serializer("http_headers", when_used="json")
    def _headers_never_written(self, value: dict[str, SecretStr]) -> dict[str, str]:
        # The job spec is stored in OUTPUT/_staging/ (with an s3:// output, in the bucket): a token must not go there.
        return {}

    def header_values(self) -> dict[str, str]:
        """The headers to send, in clear."""
        return {name: value.get_secret_value() for name, value in self.http_headers.items()}


class InputLimits(_Strict):
    """Bounds on one input line. A line past one of them becomes an error record and the job goes on; the limits
    exist so that one hostile line cannot exhaust memory or the decoder's stack."""

    max_decompressed_bytes: int = Field(
        default=1 << 40,
        ge=1,
        description="Most bytes a gzip-compressed (.gz) input file may decompress to: a small file that inflates "
        "without end fails the job, naming the file, instead of running it for days.",
    )
    max_line_bytes: int = Field(
        default=64 << 20,
        ge=1024,
        description="Longest input line (or Parquet body string) in bytes; longer ones are rejected without being "
        "held whole in memory.",
    )
    max_json_depth: int = Field(
        default=128,
        ge=8,
        le=512,
        description="Deepest nesting of JSON objects/arrays in a line (the line's own object counts as 1).",
    )
    max_custom_id_bytes: int = Field(
        default=512, ge=1, description="Longest custom_id in UTF-8 bytes (OpenAI-compatible ids are short)."
    )
    refuse_unknown_fields: bool = Field(
        default=True,
        description="A body field the route's vLLM request model does not know is the line's invalid_request "
        "('Unrecognized request argument supplied: …', as OpenAI answers), not a field vLLM ignores silently; "
        "OpenAI's bookkeeping fields (metadata, store, service_tier, user, …) pass. An http job whose servers are "
        "not vLLM (llama.cpp, SGLang) and take fields of their own may set it false to pass every field through.",
    )
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        description="Every request's cache_salt (vLLM's prefix-cache namespace), replacing any a line gives: the "
        "Batch API server sets one per API key, so a prompt prefix cached for one key is never a hit for another.",
    )
    only_url: str | None = Field(
        default=None,
        description="Serve only this route (the Batch API server sets it to a batch's `endpoint`: a batch serves "
        "one): a line whose url names another route is an unsupported_url error record.",
    )
    refused_fields: list[str] = Field(
        default_factory=list,
        description="Body fields a line may not carry: such a line is an invalid_request error record. The Batch "
        "API server refuses vLLM's per-request media options (media_io_kwargs, mm_processor_kwargs): how media is "
        "fetched and decoded is the operator's to set, not a tenant's.",
    )

    @field_validator("only_url")
    @classmethod
    def _a_served_route(cls, url: str | None) -> str | None:
        from pipeline.endpoints import SUPPORTED_URLS, endpoint_for

        if url is not None and endpoint_for(url) is None:
            raise ValueError(f"{url!r} is not a route nightshift serves; one of {', '.join(SUPPORTED_URLS)}")
        return url


class JobConfig(_Strict):
    """One batch job: input, output, model, engine, resources."""

    input: Annotated[
        str | None,
        Flag(
            "INPUT",
            "OpenAI Batch JSONL or Parquet: a file, a directory or glob of shards, s3://, http(s)://.",
        ),
    ] = Field(
        default=None,
        description="Input: an OpenAI Batch JSONL or Parquet file, a directory or glob of shards, s3://bucket/prefix "
        "or an http(s):// URL.",
    )
    output: Annotated[
        str | None,
        Flag("OUTPUT", "Output: a directory (created if missing), s3://bucket/prefix or http(s)://."),
    ] = Field(
        default=None, description="Output: a local directory, s3://bucket/prefix or an http(s):// URL (PUT)."
    )
    model: Annotated[
        str | None, Flag("--model", "Model directory or id. Default: embedded SmolLM2-135M-Instruct.")
    ] = Field(default=None, description="Model directory or id; default: the embedded SmolLM2-135M-Instruct.")
    served_model_name: Annotated[
        str | None, Flag("--served-model-name", "Name request bodies must use as `model`.")
    ] = Field(
        default=None,
        description="The name every request body's `model` must equal. Default: --model as given.",
    )
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="Engine backend and its arguments."
    )
    resources: ResourcesConfig = Field(
        default_factory=ResourcesConfig, description="Ray placement of engines."
    )
    routing: RoutingConfig = Field(
        default_factory=RoutingConfig, description="Prefix-aware routing of requests to engines."
    )
    output_options: OutputConfig = Field(
        default_factory=OutputConfig, description="Output format and sharding."
    )
    storage: StorageConfig = Field(
        default_factory=StorageConfig, description="S3 / HTTP access: endpoint, region, retries, timeouts."
    )
    limits: InputLimits = Field(
        default_factory=InputLimits, description="Bounds on one input line (length, JSON nesting, custom_id)."
    )
    media: MediaPolicy = Field(
        default_factory=MediaPolicy,
        description="Where the images and audio that lines name may be fetched from, and how much of them "
        "(media/policy.py). `nightshift serve` refuses private networks unless its operator allows them.",
    )
    overwrite: Annotated[bool, Flag("--overwrite", "Replace a completed job in OUTPUT.")] = Field(
        default=False, description="Replace a completed job already in OUTPUT."
    )
    observe: ObserveConfig = Field(
        default_factory=ObserveConfig, description="Metrics, the job report and its cost."
    )
    pools: list[PoolConfig] = Field(
        default_factory=list,
        description="Accelerator pools; default: one pool 'default' sized by `resources`.",
    )
    dataset: DatasetConfig = Field(
        default_factory=DatasetConfig,
        description="Templates over a table's columns (pipeline/datasets/): with `template` set, the input is a "
        "table and the output the table with answer columns.",
    )
    job_id: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="Job identity (seeds output ids; kept across resume). Default: random.",
    )

    @field_validator("input", "output")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        return value


def read_yaml_mapping(path: Path, name: str = "config file", kind: str = "job file") -> dict[str, Any]:
    """The mapping a YAML config file holds (the job file, the server config: `name` says which in the messages,
    `kind` what to give instead). Every way the file can be unusable is one ConfigError naming it."""
    if path.is_dir():
        raise UnreadableConfigFile(f"{name} {path} is a directory: give the path of a YAML {kind}")
    if not path.is_file():
        raise ConfigError(f"{name} {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{name} {path} is not valid YAML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise UnreadableConfigFile(
            f"{name} {path} is not UTF-8 text ({exc.reason} at byte {exc.start}): give a YAML {kind}"
        ) from exc
    except OSError as exc:
        raise UnreadableConfigFile(
            f"{name} {path} cannot be read ({exc.strerror or exc}): check its path and permissions"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{name} {path} must hold a mapping at the top level")
    return data


def load_job_config(path: str | Path | None) -> JobConfig:
    """Read a YAML job file; a missing file or a bad key fails with the path and the key to fix."""
    if path is None:
        return JobConfig()
    path = Path(path)
    data = read_yaml_mapping(path)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"config file {path}: {format_validation_error(exc)}") from exc


def format_validation_error(exc: ValidationError, labels: dict[str, str] | None = None) -> str:
    """One line per problem, named the way the user wrote it (a flag such as --max-num-seqs, or a YAML key)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{(labels or {}).get(where, where)}: {err['msg']}")
    return "; ".join(parts)


def set_dotted(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`data` with each given override (dotted key -> value; None = not given) set in place, parents created."""
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return data


def merge_overrides(
    config: JobConfig, overrides: dict[str, Any], labels: dict[str, str] | None = None
) -> JobConfig:
    """Apply CLI flags (dotted keys, None = not given) over a config; re-validates the result.

    `labels` maps dotted keys to the flags that set them, so an error names the flag the user typed.
    """
    data = set_dotted(config.model_dump(), overrides)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        given = {k: v for k, v in (labels or {}).items() if overrides.get(k) is not None}
        raise ConfigError(format_validation_error(exc, given)) from exc
