"""`manifest.json`: the account of a committed job, written last (its presence is the commit marker).

`Manifest.model_dump(mode="json")` is exactly what is written (runtime/commit/finalize.py `commit`). Sections with a fixed
shape are models; those whose keys are engines, pools, steps or a backend's own args are typed maps. `input` and
`ingest` are the job state's own records (pipeline/state.py), `engine.fitted` its fit record (pipeline/fit_record.py).

A pure module (pydantic only, no Ray, no vLLM).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from pipeline.fit_record import FitRecord
from pipeline.models import ResolvedModel
from pipeline.state import IngestRecord, InputSummary

__all__ = [
    "Cost",
    "Counts",
    "Distribution",
    "HostedPrice",
    "PoolCost",
    "RequestUsage",
    "DriverCost",
    "EngineReport",
    "Manifest",
    "Placement",
    "Recovery",
    "ServedModel",
    "Shard",
    "Shards",
    "StructuredCounts",
    "StorageRetries",
    "Throughput",
    "Tokens",
]


class _Section(BaseModel):
    # Every key the manifest holds is declared here, with what it means: a key passed in that is not is an error,
    # never silently written or dropped.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ServedAdapter(_Section):
    """A LoRA adapter the job served on a model, and what its rows used."""

    path: str = Field(description="Where it was given (a local directory, s3:// prefix or hf:// id).")
    rows: int = Field(description="Rows that named it, answered by an engine (results and engine errors).")
    prompt_tokens: int = Field(description="Prompt tokens of those rows.")
    completion_tokens: int = Field(description="Completion tokens of those rows.")


class ServedModel(_Section):
    """One model the job served (a job may serve one per pool)."""

    path: str = Field(description="Where the engines loaded it from: a local directory or a hub id.")
    task: str | None = Field(description="The task vLLM ran it for (generate, embed, …); None: the engine's.")
    pools: list[str] = Field(description="The pools that served it.")
    rows: int = Field(description="Rows its pools answered (its adapters' rows included).")
    prompt_tokens: int = Field(description="Prompt tokens of those rows.")
    completion_tokens: int = Field(description="Completion tokens of those rows.")
    adapters: dict[str, ServedAdapter] = Field(
        default_factory=dict,
        description="The LoRA adapters its pools served, by name, with their rows and tokens.",
    )


class EngineReport(_Section):
    """The engines: backend, effective args and sampling defaults, capacity, and what they did."""

    backend: str = Field(description="Engine backend (vllm, fake, …).")
    args: dict[str, Any] = Field(
        description="Effective engine args, as the first engine reported them (the spec's when none ran)."
    )
    sampling_defaults: dict[str, Any] = Field(
        description="Every sampling default the engine applied, the model's generation_config included."
    )
    engines: int = Field(description="Engine actors that reported.")
    reused: int = Field(
        default=0,
        description="Of those, warm engines another job had started (the Batch API server keeps engines between "
        "batches): this job did not pay their start.",
    )
    kv_cache_tokens_per_engine: int | None = Field(description="KV cache capacity of one engine, in tokens.")
    in_flight: dict[str, dict[str, Any]] | None = Field(
        description="Per pool: the engine's max_num_seqs, the in-flight window its actors kept, and the peak of "
        "requests inside the engine when reported."
    )
    per_engine: dict[str, dict[str, Any]] | None = Field(
        description="Per engine actor: its pool and node, the rows and chunks it ran, and how busy it was."
    )
    kv_cache_usage_peak: float | None = Field(
        description="Highest KV cache usage (0..1) any engine reported."
    )
    cpu_cores: list[list[int]] | None = Field(
        description="CPU engines: the cores each one computed on; None where vLLM bound them itself."
    )
    first_ready_at: dt.datetime | None = Field(
        description="When the first engine was ready (engine start ends, generation begins)."
    )
    fitted: FitRecord | None = Field(
        description="The engine args fitted to the data: what, from what and why (pipeline/fit_record.py, "
        "decided by runtime/ingest/fit.py)."
    )
    probed: dict[str, Any] | None = Field(
        default=None,
        description="What the backend told of itself before any work: for http, each server's identity (its "
        "/v1/models, kind and version, server and version headers, slots) and the warnings it raised.",
    )

    @field_serializer("first_ready_at")
    def _iso(self, value: dt.datetime | None) -> str | None:
        return value.isoformat() if value else None


class StructuredCounts(_Section):
    """Result rows whose request asked for JSON output (response_format json_object or json_schema, or
    structured_outputs json / json_object), and how many of them parsed as JSON."""

    requested: int = Field(default=0, description="Result rows whose request asked for JSON output.")
    parsed_json: int = Field(
        default=0,
        description="Of them, rows whose every generated text (each choice) parses as JSON; an answer cut at "
        "max_tokens (finish_reason 'length') does not.",
    )


class Counts(_Section):
    """Rows, by outcome: total = succeeded + failed."""

    total: int = Field(description="Input rows.")
    succeeded: int = Field(description="Result rows.")
    failed: int = Field(description="Error rows.")
    by_error_code: dict[str, int] = Field(description="Error rows per error code, sorted by code.")
    structured: StructuredCounts = Field(
        default_factory=StructuredCounts, description="Structured (JSON) output: asked for, and parsed."
    )


class Shard(_Section):
    """One output file."""

    name: str = Field(description="File name in OUTPUT.")
    rows: int = Field(description="Rows it holds.")
    first_custom_id: str | None = Field(description="Its first custom_id (None: an empty shard, or no id).")
    last_custom_id: str | None = Field(description="Its last custom_id.")
    bytes: int = Field(description="File size.")
    sha256: str = Field(description="sha256 of the file's bytes, hex.")


class Shards(_Section):
    results: list[Shard] = Field(description="Result shards, in custom_id order.")
    errors: list[Shard] = Field(description="Error shards, in source-position order.")


class Tokens(_Section):
    prompt: int = Field(description="Prompt tokens of every row written.")
    completion: int = Field(description="Completion tokens of every row written.")


class Placement(_Section):
    """Where each stage's tasks ran (the engines' nodes are in engine.per_engine)."""

    ingest: dict[str, dict[str, int]] | None = Field(
        description="Per ingest step: Ray node id → tasks it ran."
    )
    finalize: dict[str, int] = Field(
        description="Node id prefix (8 characters, or `driver`) → finalize tasks it ran, this attempt only."
    )
    engine_groups: dict[str, list[list[str]]] = Field(
        default_factory=dict,
        description="Per pool of sharded engines (tensor/pipeline parallel): each engine's placement group as "
        "the node id of each rank's bundle, in rank order. Empty when every engine is one rank.",
    )


class Throughput(_Section):
    rows_per_s: float = Field(description="Rows finished by engines in this run, per second of wall time.")
    output_tokens_per_s: float = Field(description="Completion tokens per second of wall time.")


class Recovery(_Section):
    """Resume, retries, and engines lost: what the job did to finish every row exactly once."""

    resumed: bool = Field(description="This run continued an interrupted job.")
    rows_from_earlier_runs: int = Field(description="Rows already staged when this run started.")
    requests_retried_after_engine_failure: int = Field(
        description="Requests started more than once because an engine died."
    )
    duplicate_deliveries_dropped: int = Field(
        description="Chunks that ran twice (their engine died after staging them) whose second copy was dropped."
    )
    leases: dict[str, int] = Field(
        description="Work-queue leases: chunks and rows issued, reissued after an engine died, duplicate acks."
    )
    engine_restarts: int = Field(description="Engine actors Ray restarted.")
    engines_lost: dict[str, dict[str, Any]] = Field(
        description="Per engine that died with work in flight: its node, the cause, the rows it had in flight "
        "and where they ran again."
    )


class StorageRetries(_Section):
    retries: int = Field(description="Storage requests retried after transient errors (driver and tasks).")
    by_operation: dict[str, int] = Field(description="Retries per operation (GET, PUT, LIST, …).")


class DriverCost(_Section):
    """What coordinating cost the driver process (all its threads): it grows with files, chunks and shards, not
    with rows."""

    cpu_s: float = Field(description="CPU seconds of the driver process.")
    peak_rss_bytes: int = Field(description="Peak resident memory of the driver process.")


class Distribution(_Section):
    """One per-request quantity over the result rows (from log-spaced histograms: a percentile is read at its
    bin's upper edge, at most ~4.4% above the exact value, never above the max)."""

    count: int = Field(description="Rows measured.")
    mean: float | None = Field(description="Mean (exact).")
    p50: float | None = Field(description="Median.")
    p90: float | None = Field(description="90th percentile.")
    p99: float | None = Field(description="99th percentile.")
    max: float | None = Field(description="Largest value (exact).")


class RequestUsage(_Section):
    """Per-request token usage and latency of the result rows; each row's own values are in Parquet output
    (columns prompt_tokens, completion_tokens, queue_wait_s, engine_s)."""

    prompt_tokens: Distribution | None = Field(description="Prompt tokens per request.")
    completion_tokens: Distribution | None = Field(description="Completion tokens per request.")
    queue_wait_s: Distribution | None = Field(
        description="Seconds from the request's chunk reaching its engine actor until the request entered the "
        "engine (engine start-up included for the first chunks)."
    )
    engine_s: Distribution | None = Field(description="Seconds inside the engine until the answer.")


class PoolCost(_Section):
    price_per_hour: float = Field(description="Price of one unit-hour (--gpu-hour-price).")
    unit: str = Field(description="accelerator (engines x GPUs per engine) or node (CPU engines' nodes).")
    units: float = Field(description="Units the pool held for this run.")
    cost: float = Field(description="price_per_hour x units x wall hours.")


class HostedPrice(_Section):
    preset: str | None = Field(description="The preset named (data/hosted_prices.yaml); None: given.")
    input_per_1m: float = Field(description="USD per 1M input (prompt) tokens.")
    output_per_1m: float = Field(description="USD per 1M output (completion) tokens.")


class Cost(_Section):
    """This run on owned hardware against a hosted batch API for the same tokens (observe/cost.py)."""

    currency: str = Field(description="Currency of every price (USD).")
    tokens: int = Field(description="Prompt + completion tokens of the job.")
    rows: int = Field(description="Rows the job answered (results).")
    wall_time_s: float = Field(description="Wall time the hardware was held for (this run).")
    pools: dict[str, PoolCost] | None = Field(
        default=None, description="Per priced pool: what it held and cost."
    )
    owned_cost: float | None = Field(default=None, description="Cost of this run on owned hardware.")
    owned_per_1m_tokens: float | None = Field(default=None, description="owned_cost per 1M tokens.")
    hosted: HostedPrice | None = Field(default=None, description="The hosted price compared with.")
    hosted_cost: float | None = Field(default=None, description="The same tokens at the hosted price.")
    hosted_per_1m_tokens: float | None = Field(default=None, description="hosted_cost per 1M tokens.")
    startup_s: float | None = Field(
        description="Fixed start-up measured in this run: seconds until the first engine was ready."
    )
    break_even_tokens: int | None = Field(
        description="Tokens from which owned hardware costs less than hosted, start-up included; None: never "
        "(or not both prices given)."
    )
    break_even_rows: int | None = Field(description="break_even_tokens in rows of this job's mix.")


class DatasetJob(_Section):
    """A dataset job's table: how its rows were made requests, and what its shards hold."""

    route: str = Field(description="The route every row's request took.")
    id_column: str | None = Field(description="The column the table is sorted by (None: input order).")
    templates: dict[str, str] = Field(description="The templates as the job rendered them, by setting.")
    answer_columns: list[str] = Field(description="The columns the output added to each row.")
    media_columns: dict[str, str] = Field(
        default_factory=dict, description="The columns each row's media came from, by kind (image, audio)."
    )
    media_root: str | None = Field(default=None, description="The directory relative media paths were under.")


class Manifest(_Section):
    """`manifest.json`. Keys in the order they are written."""

    format_version: int = Field(description="Version of this manifest's format.")
    nightshift_version: str = Field(description="The nightshift version that committed the job.")
    job_id: str = Field(description="Job identity (kept across resume).")
    created_at: dt.datetime = Field(description="When this run of the job started (UTC).")
    finished_at: dt.datetime = Field(description="When the output was committed (UTC).")
    input: InputSummary = Field(description="The input: location, fingerprint, size and line count.")
    ingest: IngestRecord | None = Field(
        description="Where validation ran (Ray node ids) and its steps' times."
    )
    model: ResolvedModel = Field(description="The job's own model: name, path, revision, source, task.")
    models: dict[str, ServedModel] = Field(
        description="Per served model name: rows answered and tokens (a job may serve one model per pool)."
    )
    engine: EngineReport = Field(description="The engines: backend, effective args, sampling defaults, fit.")
    counts: Counts = Field(description="Rows by outcome and error code.")
    shards: Shards = Field(description="Every output file: name, rows, first/last custom_id, sha256.")
    tokens: Tokens = Field(description="Token totals of the rows written.")
    placement: Placement = Field(description="Where ingest's and finalize's tasks ran.")
    wall_time_s: float = Field(description="Wall time of this run, in seconds.")
    throughput: Throughput = Field(description="Rows and output tokens per second of wall time.")
    preemptions: int = Field(description="Sequences the engines preempted (KV cache full).")
    preemption_warning: str | None = Field(
        description="With preemptions: the settings that would have avoided them."
    )
    prefix_cache_hit_rate: float | None = Field(description="Prefix-cache hits / queries over all engines.")
    adapter_loads: int | None = Field(
        default=None,
        description="LoRA adapters loaded into the engines' slots while they served, first loads and swaps, over "
        "all engines (None: no engine served adapters; vLLM's own loads as an engine starts are not counted). "
        "Adapter-aware routing keeps it low: an adapter's rows go to the engine that holds it.",
    )
    routing: dict[str, Any] = Field(
        description="Prefix-aware routing: whether it was used, rows per engine, rows routed, stolen, unkeyed."
    )
    recovery: Recovery = Field(description="Resume, retries and engines lost.")
    pools: dict[str, dict[str, Any]] = Field(
        description="Per pool: rows, tokens, engines, CPUs per engine, time to first and last result, tok/s."
    )
    storage: StorageRetries = Field(description="Storage retries made by this run.")
    driver: DriverCost = Field(description="What coordinating cost the driver process.")
    usage: RequestUsage | None = Field(
        default=None, description="Per-request token usage and latency percentiles of the result rows."
    )
    stages: dict[str, dict[str, float | None]] | None = Field(
        default=None,
        description="Per stage (ingest, fit, engines, finalize): start and end, epoch seconds, across every run.",
    )
    cost: Cost | None = Field(
        default=None,
        description="Owned hardware against hosted batch (with --gpu-hour-price / --hosted-price).",
    )
    report: str | None = Field(
        default=None, description="The job report's file name in OUTPUT (report.html)."
    )
    dataset: DatasetJob | None = Field(
        default=None,
        description="A dataset job's table (its result shards hold every input row, errors in its `error` column).",
    )

    @field_serializer("created_at", "finished_at")
    def _iso(self, value: dt.datetime) -> str:
        return value.isoformat()
