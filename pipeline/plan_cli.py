"""`nightshift plan`: the KV-cache budget of a model on a device, optionally fitted to a batch's real lengths.

The arithmetic lives in `pipeline.planner`; this module finds the model, measures the input (chat template
applied, as the engine will) and prints one table per pool, or JSON with `--json`. A sharded engine
(--tensor-parallel-size, --pipeline-parallel-size, as the job's engine args name them) is planned per device, with
one row per pipeline stage; a model whose weights leave a GPU no room is told the smallest engine that holds it.
With --config JOB.yaml every pool of the job is planned as the job runs it (`pipeline.plan_job` reads the pools):
one table per pool under its model, or in JSON one record per pool, named.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from pipeline.adapters import lora_slots
from pipeline.max_tokens import DEFAULT_CHAT_MAX_TOKENS, generation_max_tokens, output_budget
from pipeline.model_shape import ModelShape, PlanError, model_shape
from pipeline.planner import (
    DEFAULT_CPU_KV_SPACE_GIB,
    DEFAULT_DEVICES_PER_NODE,
    SHARDING_FIELDS,
    ContextFit,
    DeviceBudget,
    HistogramBucket,
    PoolPlan,
    default_block_size,
    fit_context,
    length_histogram,
    max_sequences,
    plan_pool,
    round_up,
)
from pipeline.topology import Topology, TopologyError, check_topology
from pipeline.units import GiB, fmt_bytes, parse_memory

if TYPE_CHECKING:
    from pipeline.datasets.render import RowRenderer
    from pipeline.models import ResolvedModel
    from pipeline.plan_job import PoolTarget

_BAR_WIDTH = 40


@dataclass
class InputStats:
    """What --input contributes to the plan: per-request prompt lengths and prompt + output budgets."""

    source: str
    served_name: str
    prompt_tokens: list[int] = field(default_factory=list)
    needs: list[int] = field(default_factory=list)  # prompt tokens + max_tokens, one per sequence
    invalid_by_code: dict[str, int] = field(default_factory=dict)
    assumed_output: int = 0  # chat requests without max_tokens
    untokenizable: int = 0  # requests the chat template rejected
    default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS
    generation_default: int | None = None


def plan_command(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Option(
            help="Model directory or Hugging Face id (local cache). Default: embedded SmolLM2-135M-Instruct."
        ),
    ] = None,
    input: Annotated[
        str | None,
        typer.Option(
            "--input", help="OpenAI Batch JSONL: fit max_model_len to its longest prompt + max_tokens."
        ),
    ] = None,
    gpu_memory: Annotated[
        str | None,
        typer.Option(
            help="Plan a GPU pool with this much device memory per GPU, e.g. 80GiB, 24GB, 81559MiB."
        ),
    ] = None,
    gpu_memory_utilization: Annotated[
        float, typer.Option(min=0.01, max=1.0, help="vLLM: share of GPU memory for weights + KV cache.")
    ] = 0.9,
    kv_cache_dtype: Annotated[
        str, typer.Option(help="vLLM: KV cache dtype: auto (the model's), bfloat16, float16, fp8, ...")
    ] = "auto",
    max_model_len: Annotated[
        int | None,
        typer.Option(
            min=1, help="vLLM: context to plan for. Default: fitted to --input, else the model's limit."
        ),
    ] = None,
    cpu_kvcache_space: Annotated[
        int | None,
        typer.Option(
            min=1,
            help=f"CPU engines: KV cache GiB (VLLM_CPU_KVCACHE_SPACE). Default: {DEFAULT_CPU_KV_SPACE_GIB}.",
        ),
    ] = None,
    block_size: Annotated[
        int | None, typer.Option(min=1, help="vLLM: KV block size. Default: vLLM's for the device.")
    ] = None,
    tensor_parallel_size: Annotated[
        int,
        typer.Option(min=1, help="vLLM: ranks (GPUs; CPU: core sets) that split every layer of one engine."),
    ] = 1,
    pipeline_parallel_size: Annotated[
        int, typer.Option(min=1, help="vLLM: stages one engine's layers are split into.")
    ] = 1,
    gpus_per_node: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="GPUs one node has: the most tensor_parallel_size a suggestion keeps on one node. "
            f"Default: {DEFAULT_DEVICES_PER_NODE}.",
        ),
    ] = None,
    default_max_tokens: Annotated[
        int,
        typer.Option(
            min=1,
            help="Output tokens budgeted for chat requests that set no max_tokens (vLLM would let them run to "
            "the end of the context).",
        ),
    ] = DEFAULT_CHAT_MAX_TOKENS,
    served_model_name: Annotated[
        str | None,
        typer.Option(help="With --input: the name request bodies use as `model`. Default: --model."),
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(help="With --input: the chat template prompts are rendered with. Default: the model's."),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="A job file: plan every pool of it, each with its own model, engine args and device (a pool "
            "with gpus_per_engine > 0 is planned on a GPU of --gpu-memory, the others on CPU).",
        ),
    ] = None,
) -> None:
    """The KV-cache budget per pool: weights, KV bytes per token, capacity, and the max_model_len / max_num_seqs
    it supports. With --input, the context is fitted to the batch."""
    if config is not None:
        _plan_job_file(ctx, config, input, gpu_memory, gpus_per_node, json_output)
        return
    budget = _budget(gpu_memory, gpu_memory_utilization, cpu_kvcache_space, gpus_per_node)
    topology = Topology.of(
        {"tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size}
    )
    try:
        name, model_dir = _locate_model(model, served_model_name)
        shape = model_shape(model_dir)
        check_topology(shape, topology, name)
        stats = (
            _measure_input(input, model, name, model_dir, default_max_tokens, chat_template)
            if input
            else None
        )
        pools = [_plan(shape, budget, stats, max_model_len, block_size, kv_cache_dtype, topology)]
    except (PlanError, TopologyError) as exc:
        _fail(str(exc))
    if json_output:
        typer.echo(json.dumps(_as_json(name, model_dir, shape, stats, pools), indent=2))
    else:
        _print(name, model_dir, shape, stats, pools)


# --- a job file's pools ---------------------------------------------------------------------------------------


@dataclass
class JobPoolResult:
    """One pool of a job file, planned: the pool, its model's directory and shape, what it measured of --input."""

    target: PoolTarget
    model_dir: str
    shape: ModelShape
    stats: InputStats | None
    result: PoolResult


def _plan_job_file(
    ctx: typer.Context,
    config_path: str,
    input: str | None,
    gpu_memory: str | None,
    gpus_per_node: int | None,
    json_output: bool,
) -> None:
    """`plan --config`: every pool of the job, each with its own model, engine args and device."""
    from pipeline.plan_job import COMBINE_WITH_CONFIG, job_pool_targets

    conflicts = [
        param.opts[0]
        for param in ctx.command.params
        if param.name not in COMBINE_WITH_CONFIG and _typed(ctx, param.name)
    ]
    if conflicts:
        _fail(
            f"{', '.join(conflicts)} cannot go with --config: the job file sets "
            f"{'it' if len(conflicts) == 1 else 'them'} per pool (the pool's model, the job's engine.vllm under "
            f"the pool's engine_overrides); change {config_path} instead"
        )
    try:
        targets = job_pool_targets(config_path, gpu_memory_given=gpu_memory is not None)
        batch = _JobInput.read(input, targets, _dataset_of(config_path)) if input else None
        planned = [_plan_target(target, batch, gpu_memory, gpus_per_node) for target in targets]
    except (PlanError, TopologyError) as exc:
        _fail(str(exc))
    if json_output:
        record = {"config": config_path, "pools": [_job_pool_json(pool) for pool in planned]}
        typer.echo(json.dumps(record, indent=2))
    else:
        _print_job(planned)


def _dataset_of(config_path: str) -> RowRenderer | None:
    """The job file's dataset renderer, when it names templates: --input is then its table."""
    from pipeline.config import load_job_config
    from pipeline.job_plan import JobPlan, JobPlanError

    try:
        return JobPlan.of(load_job_config(config_path)).dataset
    except JobPlanError as exc:
        raise PlanError(str(exc)) from None


def _typed(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave this option (on the command line or through its environment variable)."""
    # By the source's name: typer ships its own copy of click, whose ParameterSource is not click's.
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


@dataclass
class _JobInput:
    """--input as a job's pools measure it: every model of the job validates it (another pool's requests are valid
    lines, not invalid ones), and each model measures only the requests that name it, once for all its pools."""

    location: str
    served: dict[str, str | None]  # served name -> task, of every pool's model
    requested: Counter[str]  # valid requests by the served name they go to
    measured: dict[tuple[str, str | None], InputStats] = field(default_factory=dict)

    renderer: RowRenderer | None = None  # a dataset job's: its table's rows are made requests first

    @classmethod
    def read(cls, location: str, targets: list[PoolTarget], renderer: RowRenderer | None = None) -> _JobInput:
        served = {target.model.name: target.model.task for target in targets}
        path = _checked_input(location, renderer)
        # One validating pass, no tokenizer: a model no request names is planned without loading its tokenizer.
        scratch = InputStats(str(path), "")
        requested = Counter(
            request.body["model"] for request in _valid_requests(path, served, scratch, renderer)
        )
        return cls(location, served, requested, renderer=renderer)

    def stats(self, target: PoolTarget, name: str, model_dir: str) -> InputStats | None:
        """The input's numbers for this pool's model (and chat template); None when no request names it."""
        if not self.requested[name]:
            return None
        key = (name, target.args.chat_template)
        if key not in self.measured:
            self.measured[key] = _measure_input(
                self.location,
                target.model.path,
                name,
                model_dir,
                target.default_max_tokens,
                target.args.chat_template,
                self.served,
                target.args.runner,
                self.renderer,
            )
        return self.measured[key]


def _plan_target(
    target: PoolTarget, batch: _JobInput | None, gpu_memory: str | None, gpus_per_node: int | None
) -> JobPoolResult:
    """One pool of the job planned on its own device, with its model's requests of --input (`batch`)."""
    args = target.args
    name, model_dir = _model_dir(target.model)
    shape = model_shape(model_dir)
    topology = target.topology
    check_topology(shape, topology, f"pool {target.name} ({name})")
    budget = _budget(
        gpu_memory if target.device == "gpu" else None,
        args.gpu_memory_utilization,
        args.cpu_kvcache_space_gib,
        gpus_per_node,
    )
    stats = batch.stats(target, name, model_dir) if batch else None
    result = _plan(
        shape,
        budget,
        stats,
        args.max_model_len,
        target.block_size,
        target.kv_cache_dtype,
        topology,
        pool=target.name,
        max_model_len_source="job file",
        lora=lora_slots(args.model_dump()),
    )
    if batch and stats is None:
        note = f"no valid request of {batch.location} names {name!r}: nothing to fit this pool's context to"
        result.plan = result.plan.model_copy(update={"notes": [*result.plan.notes, note]})
    return JobPoolResult(target, model_dir, shape, stats, result)


# --- inputs ----------------------------------------------------------------------------------------------------


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _budget(
    gpu_memory: str | None,
    utilization: float,
    cpu_kvcache_space: int | None,
    gpus_per_node: int | None = None,
) -> DeviceBudget:
    if gpu_memory is None:
        return DeviceBudget.cpu(cpu_kvcache_space or DEFAULT_CPU_KV_SPACE_GIB, _host_memory())
    try:
        memory = parse_memory(gpu_memory)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--gpu-memory") from None
    return DeviceBudget.gpu(memory, utilization, devices_per_node=gpus_per_node)


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: skip the host-memory check
        return None


def _locate_model(model: str | None, served_model_name: str | None) -> tuple[str, str]:
    """(served name, local directory holding config.json); a hub id must already be in the local HF cache."""
    from pipeline.models import MissingDependencyError, ModelNotFoundError, resolve_model

    try:
        resolved = resolve_model(model, served_model_name)
    except (ModelNotFoundError, MissingDependencyError) as exc:
        raise PlanError(str(exc)) from None
    return _model_dir(resolved)


def _model_dir(resolved: ResolvedModel) -> tuple[str, str]:
    """(served name, local directory holding config.json) of a resolved model; a hub id's from the local cache."""
    if resolved.source != "hub-id":
        return resolved.name, resolved.path
    try:
        from huggingface_hub import snapshot_download

        # Config and headers are all a plan reads; never download for it.
        return resolved.name, snapshot_download(resolved.path, local_files_only=True)
    except Exception:  # noqa: BLE001 - hub errors vary by version; the cause is always "not cached"
        raise PlanError(
            f"model {resolved.path!r} is neither a local directory nor in the local Hugging Face cache: "
            f"download it first (huggingface-cli download {resolved.path}) or pass its directory"
        ) from None


def _measure_input(
    location: str,
    model: str | None,
    served_name: str,
    model_dir: str,
    chat_default: int,
    chat_template: str | None = None,
    job_models: dict[str, str | None] | None = None,
    runner: str = "auto",
    renderer: RowRenderer | None = None,
) -> InputStats:
    """Prompt tokens (chat template applied) and prompt + output budget of every valid request in the file.

    `job_models` (served name -> task): every model of the job, when the model planned is one of several; the
    requests of the others are valid lines of the job, left out of this model's numbers."""
    from pipeline.engines.base import engine_class
    from pipeline.models import resolve_model
    from pipeline.tokens import PromptCounter

    path = _checked_input(location, renderer)
    try:
        # Prompts counted as the engine will count them (chat template applied).
        resolved = resolve_model(model, runner=runner)
        # `plan` sizes vLLM's engines: an image or audio part costs what vLLM's processor makes of it.
        media = engine_class("vllm").media_tokens(resolved, {})
        counter = PromptCounter.for_model(resolved.path, chat_template, resolved.task, media)
    except ValueError as exc:  # a --chat-template naming no file
        raise PlanError(str(exc)) from None
    if counter is None:
        raise PlanError(
            "measuring --input needs the model's tokenizer: pip install 'nightshift-batch[model]'"
        )
    stats = InputStats(
        str(path),
        served_name,
        default_max_tokens=chat_default,
        generation_default=generation_max_tokens(model_dir),
    )
    for request in _valid_requests(path, job_models or {served_name: resolved.task}, stats, renderer):
        if request.body["model"] != served_name:  # another pool's model: measured with that pool
            continue
        try:
            prompts = _prompt_lengths(counter, request)
        except Exception:  # noqa: BLE001 - a template failure is the engine's to report at run time
            stats.untokenizable += 1
            continue
        output, assumed = output_budget(request.url, request.body, stats.generation_default, chat_default)
        stats.assumed_output += assumed
        for prompt in prompts:
            stats.prompt_tokens.append(prompt)
            stats.needs.append(prompt + output)
    if not stats.needs:
        raise PlanError(
            f"{location} holds no valid request to fit the context to (see `nightshift validate`)"
        )
    return stats


def _checked_input(location: str, renderer: RowRenderer | None) -> Path:
    """--input, checked as the job would check it: request lines, or a dataset job's table with the columns its
    templates name."""
    from pipeline.datasets.render import DatasetError
    from pipeline.runtime.preflight import PreflightError, check_input

    try:
        path = check_input(location, table=renderer.table_read() if renderer else None)
        if renderer is not None:
            renderer.check_table(_table_source(path, renderer))
    except (PreflightError, DatasetError) as exc:
        raise PlanError(str(exc)) from None
    return path


def _table_source(path: Path, renderer: RowRenderer):
    """A dataset job's table at `path`, read as its renderer reads it."""
    from pipeline.io.readers import input_source

    source = input_source(str(path))
    source.table = renderer.table_read()
    return source


def _valid_requests(
    path: Path, served: dict[str, str | None], stats: InputStats, renderer: RowRenderer | None = None
):
    """The requests a job would run: lines that fail validation (including another model's name) are skipped; a
    dataset job's rows (`renderer`) are made requests first."""
    from pipeline.stages.intake import InputCounts, iter_validated
    from pipeline.stages.validate import LineValidator, ValidRequest

    source = _table_source(path, renderer) if renderer is not None else None  # its columns: _checked_input
    report = InputCounts(source=str(path))
    for outcome in iter_validated(source or path, LineValidator(served), report, renderer):
        if isinstance(outcome, ValidRequest):
            yield outcome
    stats.invalid_by_code = dict(report.invalid_by_code)


def _prompt_lengths(counter, request) -> list[int]:
    """Sequences a request starts, by prompt tokens (a list of prompts, token ids, score pairs: one each; each
    prompt once per sample, `n`)."""
    from pipeline.engines.fitting import sequence_prompts

    return sequence_prompts(request.url, request.body, counter.count(request.url, request.body))


# --- the plan --------------------------------------------------------------------------------------------------


@dataclass
class PoolResult:
    plan: PoolPlan
    budget: DeviceBudget
    fit: ContextFit | None
    context_source: str  # where plan.context came from, in the user's words


def _plan(
    shape: ModelShape,
    budget: DeviceBudget,
    stats: InputStats | None,
    max_model_len: int | None,
    block_size: int | None,
    kv_cache_dtype: str,
    topology: Topology | None = None,
    pool: str | None = None,
    max_model_len_source: str = "--max-model-len",
    lora: tuple[int, int] | None = None,
) -> PoolResult:
    """One pool's plan; `pool` names it (default: its device), `max_model_len_source` says who set max_model_len."""
    block = block_size or default_block_size(budget.device, shape.is_mla)
    fit = fit_context(stats.needs, block, shape.max_model_len_limit) if stats else None
    context = max_model_len or (fit.context if fit else None)
    plan = plan_pool(shape, budget, context, block, kv_cache_dtype, pool=pool, topology=topology, lora=lora)
    if stats and fit:
        plan = plan.model_copy(update=_input_remarks(shape, plan, stats, fit))
    source = max_model_len_source if max_model_len else "fitted to --input" if fit else "model limit"
    return PoolResult(plan, budget, fit, source)


def _input_remarks(
    shape: ModelShape, plan: PoolPlan, stats: InputStats, fit: ContextFit
) -> dict[str, list[str]]:
    """Notes and warnings that tie the plan to the measured batch."""
    notes, warnings = list(plan.notes), list(plan.warnings)
    if stats.assumed_output:
        notes.append(
            f"{stats.assumed_output} chat request(s) set no max_tokens: budgeted {stats.default_max_tokens} output "
            f"tokens each (--default-max-tokens); vLLM lets them generate until the context ends"
        )
    if stats.untokenizable:
        warnings.append(
            f"{stats.untokenizable} request(s) could not be tokenized (chat template error) and were left out; "
            f"the engine will reject them"
        )
    other_model = stats.invalid_by_code.get("model_not_found", 0)
    if other_model:
        notes.append(
            f"{other_model} line(s) name a model other than {stats.served_name!r} and were left out, as a job "
            f"would fail them; pass --served-model-name if they are meant for this model"
        )
    too_long = sum(1 for p in stats.prompt_tokens if p > plan.context)
    cut = sum(1 for p, n in zip(stats.prompt_tokens, stats.needs, strict=True) if p <= plan.context < n)
    if too_long:
        warnings.append(
            f"{too_long} prompt(s) are longer than max_model_len {plan.context:,}: they will fail with "
            f"context_length_exceeded"
        )
    if cut:
        warnings.append(
            f"{cut} request(s) need more than max_model_len {plan.context:,} (prompt + max_tokens): vLLM cuts "
            f"their output at the context end (finish_reason 'length')"
        )
    mean_context = round_up(int(fit.mean + 0.5), plan.block_size)
    typical = max_sequences(shape, plan.kv_blocks, mean_context, plan.block_size)
    if plan.max_concurrent_seqs and typical > plan.max_concurrent_seqs:
        notes.append(
            f"requests average {fit.mean:,.0f} tokens (prompt + max_tokens): about {typical:,} of those fit at "
            f"once; max_num_seqs above the recommendation pays only if outputs stop early, else it preempts"
        )
    return {"notes": notes, "warnings": warnings}


# --- output ----------------------------------------------------------------------------------------------------


def _as_json(
    name: str, model_dir: str, shape: ModelShape, stats: InputStats | None, pools: list[PoolResult]
) -> dict[str, Any]:
    return {
        "model": {"name": name, "path": model_dir, "shape": shape.model_dump()},
        "input": _input_json(stats) if stats else None,
        "pools": [_pool_json(pool) for pool in pools],
    }


def _pool_json(pool: PoolResult) -> dict[str, Any]:
    return {
        "budget": _budget_json(pool.budget),
        "fit": pool.fit.model_dump() if pool.fit else None,
        "context_source": pool.context_source,
        **_plan_json(pool.plan),
    }


def _job_pool_json(pool: JobPoolResult) -> dict[str, Any]:
    """A job's pool: its name, its model and what it measured of --input, then its plan as `_pool_json` gives it."""
    return {
        "name": pool.target.name,
        "model": {"name": pool.target.model.name, "path": pool.model_dir, "shape": pool.shape.model_dump()},
        "input": _input_json(pool.stats) if pool.stats else None,
        **_pool_json(pool.result),
    }


def _budget_json(budget: DeviceBudget) -> dict[str, Any]:
    """The budget's fields; devices_per_node only when given (a one-device plan reads as it always has)."""
    return budget.model_dump(exclude={"devices_per_node"} if budget.devices_per_node is None else None)


def _plan_json(plan: PoolPlan) -> dict[str, Any]:
    """The plan's fields; those of sharding only when set, so a one-device plan reads as it always has."""
    record = plan.model_dump()
    defaults = {
        name: PoolPlan.model_fields[name].get_default(call_default_factory=True) for name in SHARDING_FIELDS
    }
    return {key: value for key, value in record.items() if key not in defaults or value != defaults[key]}


def _input_json(stats: InputStats) -> dict[str, Any]:
    return {
        "path": stats.source,
        "sequences": len(stats.needs),
        "served_model_name": stats.served_name,
        "invalid_lines_by_code": stats.invalid_by_code,
        "assumed_output_requests": stats.assumed_output,
        "untokenizable_requests": stats.untokenizable,
        "default_max_tokens": stats.default_max_tokens,
        "prompt_tokens": _quantiles(stats.prompt_tokens),
        "prompt_plus_max_tokens": _quantiles(stats.needs),
        "prompt_histogram": [b.model_dump() for b in length_histogram(stats.prompt_tokens)],
    }


def _quantiles(values: list[int]) -> dict[str, int]:
    ordered = sorted(values)
    return {
        "min": ordered[0],
        "median": int(statistics.median(ordered)),
        "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        "max": ordered[-1],
    }


def _print(
    name: str, model_dir: str, shape: ModelShape, stats: InputStats | None, pools: list[PoolResult]
) -> None:
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    console.print(f"[bold]model[/bold]  {name}  ({model_dir})")
    console.print(f"[bold]shape[/bold]  {_describe_shape(shape)}")
    if stats:
        _print_input(console, stats, pools[0].fit)
    for pool in pools:
        console.print()
        console.print(_pool_table(pool))
        if pool.plan.sharded:
            console.print(_stage_table(pool.plan))
        for note in pool.plan.notes:
            console.print(f"  [dim]•[/dim] {note}")
        for warning in pool.plan.warnings:
            console.print(f"  [bold yellow]![/bold yellow] {warning}")


def _print_job(planned: list[JobPoolResult]) -> None:
    """Each model once, with the tables of the pools that serve it under it, in the job's order of pools."""
    by_model: dict[tuple[str, str, str | None], list[JobPoolResult]] = {}
    for pool in planned:
        key = (pool.target.model.name, pool.model_dir, pool.target.args.chat_template)
        by_model.setdefault(key, []).append(pool)
    for index, pools in enumerate(by_model.values()):
        if index:
            typer.echo()
        first = pools[0]
        _print(first.target.model.name, first.model_dir, first.shape, first.stats, [p.result for p in pools])


def _describe_shape(shape: ModelShape) -> str:
    if shape.is_mla:
        attention = f"MLA latent {shape.kv_lora_rank} + rope {shape.qk_rope_head_dim}"
    else:
        attention = f"{shape.attention_heads} heads / {shape.kv_heads} KV heads × head_dim {shape.head_dim}"
    window = (
        f", sliding window {shape.sliding_window:,} on {shape.sliding_window_layers} layers"
        if shape.sliding_window
        else ""
    )
    return (
        f"{shape.model_type}, {shape.layers} layers, {attention}, {shape.dtype}, "
        f"context limit {shape.max_model_len_limit:,}{window}"
    )


def _print_input(console, stats: InputStats, fit: ContextFit | None) -> None:
    q = _quantiles(stats.prompt_tokens)
    console.print()
    skipped = ""
    if stats.invalid_by_code:
        codes = ", ".join(f"{code} {n}" for code, n in sorted(stats.invalid_by_code.items()))
        skipped = (
            f"; skipped {sum(stats.invalid_by_code.values())} line(s) that would fail validation ({codes})"
        )
    console.print(f"[bold]input[/bold]  {stats.source}: {len(stats.needs)} sequence(s){skipped}")
    console.print(
        f"  prompt tokens (chat template applied): min {q['min']:,}, median {q['median']:,}, p95 {q['p95']:,}, "
        f"max {q['max']:,}"
    )
    if fit:
        capped = f", capped at the model limit {fit.model_limit:,}" if fit.longest > fit.model_limit else ""
        console.print(
            f"  longest prompt + max_tokens: {fit.longest:,} → fitted max_model_len {fit.context:,} "
            f"(rounded up to blocks of {fit.block_size}{capped})"
        )
    console.print("  prompt tokens histogram:")
    for line in _histogram_lines(length_histogram(stats.prompt_tokens)):
        console.print(f"    {line}")


def _histogram_lines(buckets: list[HistogramBucket]) -> list[str]:
    top = max((b.count for b in buckets), default=0) or 1
    width = max(len(f"{b.low:,}–{b.high:,}") for b in buckets) if buckets else 0
    lines = []
    for b in buckets:
        bar = "█" * round(_BAR_WIDTH * b.count / top) if b.count else ""
        lines.append(f"{f'{b.low:,}–{b.high:,}':>{width}}  {bar:<{_BAR_WIDTH}} {b.count:,}")
    return lines


def _pool_table(pool: PoolResult):
    from rich.table import Table

    plan = pool.plan
    # A pool named for its device (a plan of flags) says it once; a job's pool says its name and its device.
    title = f"pool {plan.pool}" if plan.pool == plan.device else f"pool {plan.pool} ({plan.device})"
    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    weights = fmt_bytes(plan.weights_bytes) if plan.weights_bytes is not None else "unknown"
    ranks = plan.tensor_parallel_size * plan.pipeline_parallel_size
    if plan.sharded:
        table.add_row(
            "topology",
            f"TP={plan.tensor_parallel_size} PP={plan.pipeline_parallel_size}",
            f"{ranks} ranks per engine, "
            + ("one GPU each" if plan.device == "gpu" else "one CPU worker each"),
        )
    table.add_row(
        "weights", weights, "checkpoint tensors" if plan.weights_bytes is not None else "no weight files"
    )
    if plan.sharded:
        on_device = plan.weights_per_device_bytes
        table.add_row(
            "weights / rank",
            fmt_bytes(on_device) if on_device is not None else "unknown",
            f"≈ weights / {ranks} ranks",
        )
        table.add_row("KV budget / rank", fmt_bytes(plan.kv_budget_bytes), _budget_source(pool.budget, True))
        table.add_row(
            "KV bytes / token",
            f"{plan.kv_bytes_per_token:,}",
            f"kv_cache_dtype {plan.kv_cache_dtype}, whole model",
        )
    else:
        table.add_row("KV budget", fmt_bytes(plan.kv_budget_bytes), _budget_source(pool.budget))
        table.add_row(
            "KV bytes / token", f"{plan.kv_bytes_per_token:,}", f"kv_cache_dtype {plan.kv_cache_dtype}"
        )
    table.add_row("block size", f"{plan.block_size}", "tokens")
    blocks = f"{plan.kv_blocks:,} blocks" + (", on every rank" if plan.sharded else "")
    table.add_row("KV capacity", f"{plan.kv_capacity_tokens:,}", f"tokens ({blocks})")
    table.add_row("context (max_model_len)", f"{plan.context:,}", pool.context_source)
    table.add_row("max concurrent seqs", f"{plan.max_concurrent_seqs:,}", f"at {plan.context:,} tokens each")
    table.add_row("recommended max_model_len", _or_none(plan.recommended_max_model_len), "")
    table.add_row("recommended max_num_seqs", _or_none(plan.recommended_max_num_seqs), "")
    return table


def _stage_table(plan: PoolPlan):
    """One row per pipeline stage: what each of its ranks (devices) holds."""
    from rich.table import Table

    table = Table(title="per rank", title_justify="left", box=None, pad_edge=False, header_style="bold")
    for column in ("stage", "ranks", "layers", "KV heads", "weights", "KV budget", "KV B/token"):
        table.add_column(column, justify="left" if column == "ranks" else "right")
    table.add_column("KV capacity", justify="right")
    for stage in plan.stages:
        ranks = f"{stage.ranks[0]}" if len(stage.ranks) == 1 else f"{stage.ranks[0]}–{stage.ranks[-1]}"
        table.add_row(
            f"{stage.stage}",
            ranks,
            f"{stage.layers}",
            f"{stage.kv_heads}",
            fmt_bytes(stage.weights_bytes) if stage.weights_bytes is not None else "unknown",
            fmt_bytes(stage.kv_budget_bytes),
            f"{stage.kv_bytes_per_token:,}",
            f"{stage.kv_capacity_tokens:,}",
        )
    return table


def _budget_source(budget: DeviceBudget, per_device: bool = False) -> str:
    if budget.device == "cpu":
        space = f"VLLM_CPU_KVCACHE_SPACE={(budget.cpu_kv_space_bytes or 0) // GiB}"
        return f"{space} on every rank" if per_device else space
    weights = "weights / rank" if per_device else "weights"
    return f"{fmt_bytes(budget.memory_bytes or 0)} × {budget.utilization:g} − {weights} − reserve"


def _or_none(value: int | None) -> str:
    return f"{value:,}" if value is not None else "none fits"
