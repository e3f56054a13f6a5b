"""Engine args fitted to the data before the engines start: `nightshift plan --input`, applied to the job.

Every valid request is measured once, where ingest reads it (the ingest tasks on the cluster, runtime/ingest/tasks.py,
given a `MeasureSpec`), with the counter the engine agrees with (the model's tokenizer and chat template for vLLM,
see `pipeline.tokens`; loaded once per worker process); only the aggregate (`Lengths`, mergeable) reaches the
driver. A work list staged without measuring is measured here instead (`measure`: one streaming pass over the
request parts, a read batch at a time). From the measurements:

- max_model_len, unless given: the longest prompt + its output budget, rounded up to a KV block, capped at the
  model's limit. Halving an oversized context doubles the sequences that fit. No request can need more than the
  fitted length by construction; only one that sets no max_tokens and whose default budget passes the model's own
  limit can, and vLLM cuts its output there.
- max_num_seqs, unless given: the sequences the KV cache holds when every one grows as long as it can (its prompt +
  output budget, at most max_model_len; at most 256), so the engine never has to preempt. A given max_num_seqs
  above that is kept, with a warning that names the number. Requests are measured even when max_model_len is given.
- A request whose prompt alone reaches the model's limit (no room for one output token), or whose own max_tokens
  does not fit in what its prompt leaves of that limit, can never run as asked: it becomes a
  `context_length_exceeded` error record where it is measured and stays out of the work list, so it never reaches
  an engine and never makes the context of every other request the model's limit.

The output budget of a request is what vLLM would allow: max_completion_tokens, else max_tokens; without either,
16 for /v1/completions, the model's generation_config max_new_tokens, else — for chat, where vLLM lets the answer
run to the end of the context (max_tokens = max_model_len − prompt), which cannot be planned for — the configured
default (engine.fit.default_max_tokens, 256). Such a request may still generate up to the fitted max_model_len minus
its prompt; the manifest says how many requests were budgeted that way.

Everything decided is kept in `_staging/job.json` (a resumed job runs with the same values) and goes to the
manifest as `engine.fitted`: what was fitted, from what, and why. Backends: vllm (tokenizer; KV capacity from the
model config on CPU, or from num_gpu_blocks_override; on GPUs the capacity is known only once an engine starts, so
max_num_seqs keeps its default there) and fake (its own word count; its concurrency is max_concurrency, not fitted),
by what their registry entry says fitting can know (engines/base.py `Backend.fitting`). A backend whose engine args
are not nightshift's (http: the servers') is not fitted, and its requests are not measured.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from pipeline.config import DEFAULT_MAX_NUM_SEQS, JobConfig, effective_pools
from pipeline.engines.base import backend
from pipeline.io.staging import INGEST_PREFIX, StagedRow, StagingArea
from pipeline.json_codec import loads
from pipeline.models import ResolvedModel
from pipeline.planner import MAX_NUM_SEQS_CAP, requested_max_tokens, round_up
from pipeline.protocol import ErrorCode, dumps, failed_request_record
from pipeline.state import JobState

log = structlog.get_logger(__name__)

# Error parts of the fit pass: named after the request part they came from, so a redone pass replaces them, and
# under the ingest prefix, so they count as rejected before any engine ran (a redone ingest discards them too).
FIT_ERRORS_PREFIX = f"{INGEST_PREFIX}-fit"
READ_BATCH_ROWS = 1024


# --- what a backend contributes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class KvCapacity:
    """One pool's KV cache: usable blocks and how many sequences of a given length they hold."""

    blocks: int  # blocks a scheduler can hand out (vLLM keeps one more as its null block)
    block_size: int
    sequences: Callable[[int], int]  # sequences that fit at once when each grows to `context` tokens

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


@dataclass(frozen=True)
class FitTarget:
    """What fitting needs from an engine backend."""

    counted_by: str  # how prompts are counted, for the record
    count: Callable[[Sequence[tuple[str, dict]]], list[list[int] | Exception]]  # prompt tokens per sequence
    output_budget: Callable[[str, dict], tuple[int, bool]]  # (output tokens, whether that is an assumption)
    model_limit: int  # the longest context the engine accepts
    block_size: Callable[[dict, str], int]  # (pool args, device) -> KV block size
    # (pool args, device) -> KV capacity, None when unknown
    capacity: Callable[[dict, str], KvCapacity | None]
    notes: list[str] = field(default_factory=list)


def _vllm_target(config: JobConfig, model: ResolvedModel) -> FitTarget | str:
    from pipeline.planner import (
        DeviceBudget,
        PlanError,
        default_block_size,
        generation_max_tokens,
        max_sequences,
        model_shape,
        output_budget,
        plan_pool,
    )
    from pipeline.tokens import load_chat_template

    model_dir = _model_dir(model)
    if model_dir is None:
        return f"model {model.path!r} is not a local directory or in the local Hugging Face cache"
    try:
        shape = model_shape(model_dir)
    except PlanError as exc:
        return f"cannot read the model's shape: {exc}"
    args = config.engine.vllm
    try:
        load_chat_template(args.chat_template)
    except ValueError as exc:  # a --chat-template that names no file: the engine would refuse it as well
        return str(exc)
    if importlib.util.find_spec("transformers") is None:
        return "measuring requests needs the model's tokenizer: pip install 'nightshift-batch[model]'"
    generation_default = generation_max_tokens(
        model_dir, args.generation_config, args.override_generation_config
    )
    chat_default = config.engine.fit.default_max_tokens

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
                blocks = plan_pool(shape, budget, None, block, extra.get("kv_cache_dtype", "auto")).kv_blocks
            except PlanError:
                return None
        else:
            return None  # GPU memory is known to the engine, not to the driver
        usable = max(0, blocks - 1)  # vLLM's block pool keeps one block as its null block
        return KvCapacity(usable, block, lambda context: max_sequences(shape, usable, context, block))

    return FitTarget(
        counted_by=f"{model.name} tokenizer + chat template",
        # The tokenizer loads on the first count, once per process (`prompt_counter`): the driver, which only
        # decides, never loads it; each ingest worker loads it once, whatever the number of its tasks.
        count=_own_requests(
            model.name,
            lambda requests: prompt_counter(model_dir, args.chat_template, model.task).count_batch(requests),
        ),
        output_budget=lambda url, body: output_budget(url, body, generation_default, chat_default),
        model_limit=shape.max_model_len_limit,
        block_size=block_size,
        capacity=capacity,
    )


def _fake_target(config: JobConfig, model: ResolvedModel) -> FitTarget:
    from pipeline.endpoints import endpoint_for
    from pipeline.engines.fake import FAKE_MAX_MODEL_LEN, sequence_tokens

    default_output = config.engine.fake.output_tokens

    def count(requests: Sequence[tuple[str, dict]]) -> list[list[int] | Exception]:
        return [sequence_tokens(url, body) for url, body in requests]

    count = _own_requests(model.name, count)

    def output(url: str, body: dict) -> tuple[int, bool]:
        endpoint = endpoint_for(url)
        if endpoint is None or not endpoint.generates:
            return 0, False  # pooling routes generate nothing
        return int(requested_max_tokens(body) or default_output), False

    return FitTarget(
        counted_by="the fake engine's word count",
        count=count,
        output_budget=output,
        model_limit=FAKE_MAX_MODEL_LEN,
        block_size=lambda args, device: 16,
        capacity=lambda args, device: None,
        notes=["fake engine: its concurrency is engine.fake.max_concurrency; max_num_seqs is not fitted"],
    )


def _own_requests(
    name: str, count: Callable[[Sequence[tuple[str, dict]]], list[list[int] | Exception]]
) -> Callable[[Sequence[tuple[str, dict]]], list[list[int] | Exception]]:
    """`count` for the requests of the model fitting is for; a request for another model of the job (a pool of
    its own) starts no sequence here: that pool runs with its model's own limits (runtime.job.pool_spec)."""

    def counted(requests: Sequence[tuple[str, dict]]) -> list[list[int] | Exception]:
        own = [i for i, (_, body) in enumerate(requests) if body.get("model") in (None, name)]
        if len(own) == len(requests):
            return count(requests)
        out: list[list[int] | Exception] = [[] for _ in requests]
        for i, result in zip(own, count([requests[i] for i in own]), strict=True):
            out[i] = result
        return out

    return counted


# By what a backend's registry entry says fitting can know of it (engines/base.py Backend.fitting).
_TARGETS: dict[str, Callable[[JobConfig, ResolvedModel], FitTarget | str]] = {
    "tokenizer+kv": _vllm_target,
    "word-count": _fake_target,
}

# Per process: what a worker built once serves every ingest task it runs (a tokenizer takes a second to load).
_FIT_TARGETS: dict[tuple[Callable, str, str], FitTarget | str] = {}
_PROMPT_COUNTERS: dict[str, Any] = {}


def prompt_counter(model_dir: str, chat_template: str | None = None, task: str | None = None):
    """The model's PromptCounter (see PromptCounter.for_model), loaded once per process."""
    from pipeline.tokens import PromptCounter

    key = f"{model_dir}\0{chat_template}\0{task}"
    counter = _PROMPT_COUNTERS.get(key)
    if counter is None:
        counter = _PROMPT_COUNTERS[key] = PromptCounter.for_model(model_dir, chat_template, task)
    return counter


def tokenizers_loaded() -> int:
    """Tokenizers this process has loaded (an ingest task reports how many it had to load itself)."""
    return len(_PROMPT_COUNTERS)


def fit_target(config: JobConfig, model: ResolvedModel) -> FitTarget | str:
    """What fitting needs from the job's backend, or why it cannot be fitted; built once per process."""
    entry = backend(config.engine.backend)
    builder = _TARGETS.get(entry.fitting or "")
    if builder is None:
        return entry.no_fit_reason or f"the {entry.name} backend cannot count tokens"
    key = (builder, model.model_dump_json(), config.engine.model_dump_json())
    if key not in _FIT_TARGETS:
        _FIT_TARGETS[key] = builder(config, model)
    return _FIT_TARGETS[key]


@dataclass(frozen=True)
class MeasureSpec:
    """What the ingest tasks need to measure requests as fitting would: the job's config and model (each worker
    builds the FitTarget from them once) and the model's limit, past which a request is rejected."""

    config: JobConfig
    model: ResolvedModel
    limit: int

    def target(self) -> FitTarget:
        target = fit_target(self.config, self.model)
        if isinstance(target, str):
            raise RuntimeError(f"cannot measure requests on this worker: {target}")
        return target


def measuring(config: JobConfig, model: ResolvedModel) -> MeasureSpec | None:
    """How ingest measures the job's requests, or None when the job is not fitted (nothing is then measured and no
    request is rejected for its length, as `_decide` would do)."""
    if not config.engine.fit.enabled:
        return None
    target = fit_target(config, model)
    return None if isinstance(target, str) else MeasureSpec(config, model, target.model_limit)


def _model_dir(model: ResolvedModel) -> str | None:
    if model.source != "hub-id":
        return model.path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model.path, local_files_only=True)
    except Exception:  # noqa: BLE001 - hub errors vary by version; the cause is always "not cached"
        return None


# --- measuring ---------------------------------------------------------------------------------------------------


@dataclass
class Lengths:
    """What the measuring pass learned, in running totals (never one entry per request)."""

    requests: int = 0
    sequences: int = 0
    longest_need: int = 0  # prompt + output budget
    longest_id: str | None = None
    longest_prompt_of_longest: int = 0
    longest_prompt: int = 0
    prompt_sum: int = 0
    need_sum: int = 0
    assumed_output: int = 0  # chat requests budgeted the default output (no max_tokens anywhere)
    untokenizable: int = 0  # requests the chat template rejected: left to the engine, which rejects them too
    output_capped: int = (
        0  # set no max_tokens; prompt fits the model's limit, prompt + default budget does not
    )
    too_long: int = 0  # prompt reaches the model's limit: rejected here
    seconds: float = 0.0
    # Where the longest request is, (file index, line): of equally long ones the first in the input is named, so
    # aggregates merged in any order name the request one pass over the input would.
    longest_at: tuple[int, int] | None = None

    def add(
        self,
        custom_id: str,
        prompts: list[int],
        output: int,
        assumed: bool,
        limit: int,
        at: tuple[int, int] | None = None,
    ) -> None:
        """One request, added in input order (a tie keeps the earlier one)."""
        self.requests += 1
        self.assumed_output += assumed
        capped = False
        for prompt in prompts:
            need = prompt + output
            self.sequences += 1
            self.prompt_sum += prompt
            self.need_sum += need
            self.longest_prompt = max(self.longest_prompt, prompt)
            capped |= need > limit
            if need > self.longest_need:
                self.longest_need, self.longest_id, self.longest_prompt_of_longest = need, custom_id, prompt
                self.longest_at = at
        self.output_capped += capped

    _SUMS = (
        "requests",
        "sequences",
        "prompt_sum",
        "need_sum",
        "assumed_output",
        "untokenizable",
        "output_capped",
        "too_long",
        "seconds",
    )

    def merge(self, other: Lengths) -> Lengths:
        """Fold in the lengths of other requests (another part of the input); returns self. Sums add, maxima take
        the larger; the longest request is the earlier one (by `longest_at`) when two are equally long."""
        for name in self._SUMS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.longest_prompt = max(self.longest_prompt, other.longest_prompt)
        if other.longest_need > self.longest_need or (
            other.longest_need == self.longest_need
            and other.longest_id is not None
            and (self.longest_id is None or _earlier(other.longest_at, self.longest_at))
        ):
            self.longest_need, self.longest_id = other.longest_need, other.longest_id
            self.longest_prompt_of_longest, self.longest_at = (
                other.longest_prompt_of_longest,
                other.longest_at,
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (kept in _staging/job.json between ingest and fitting)."""
        return {**asdict(self), "longest_at": list(self.longest_at) if self.longest_at else None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lengths:
        at = data.get("longest_at")
        return cls(**{**data, "longest_at": tuple(at) if at else None})

    def summary(self) -> dict[str, Any]:
        n = self.sequences or 1
        return {
            "requests": self.requests,
            "sequences": self.sequences,
            "prompt_tokens": {"max": self.longest_prompt, "mean": round(self.prompt_sum / n, 1)},
            "prompt_plus_max_tokens": {"max": self.longest_need, "mean": round(self.need_sum / n, 1)},
            "longest_request": self.longest_id,
            "assumed_output_requests": self.assumed_output,
            "untokenizable_requests": self.untokenizable,
            "output_capped_requests": self.output_capped,
            "seconds": round(self.seconds, 2),
        }


def _earlier(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    return a is not None and (b is None or a < b)


def context_problem(prompt: int, requested: int | None, limit: int) -> str | None:
    """Why a request can never run within the model's context, or None. A prompt that fills it leaves no room for
    one output token; a max_tokens the rest of the context cannot hold (1e30, or simply too many) is refused as
    OpenAI refuses it — never a reason to size every other request's context to the model's limit."""
    if prompt >= limit:
        return (
            f"This model's maximum context length is {limit} tokens. However, your prompt contains {prompt} "
            f"input tokens, which leaves no room for even one output token. Please reduce the length of the "
            f"input prompt."
        )
    if requested is not None and prompt + requested > limit:
        return (
            f"This model's maximum context length is {limit} tokens. However, you requested {prompt + requested} "
            f"tokens ({prompt} in the messages, {requested} in the completion). Please reduce the length of the "
            f"messages or completion."
        )
    return None


def measure(staging: StagingArea, target: FitTarget, limit: int, job_id: str | None = None) -> Lengths:
    """One streaming pass over the work list: lengths of every request; prompts of `limit` tokens or more become
    context_length_exceeded error records and leave the work list (per part: error part first, then the rewrite,
    so a pass cut short between the two is redone without loss or duplicates)."""
    lengths = Lengths()
    started = time.monotonic()
    columns = ["custom_id", "url", "body", "line", "source"]
    for part in staging.request_files():
        rejected: list[StagedRow] = []
        for batch in staging.files.parquet(part).iter_batches(batch_size=READ_BATCH_ROWS, columns=columns):
            rows = batch.to_pydict()
            bodies = [loads(body) for body in rows["body"]]
            counts = target.count(list(zip(rows["url"], bodies, strict=True)))
            for i, prompts in enumerate(counts):
                custom_id = rows["custom_id"][i]
                if isinstance(prompts, Exception):
                    lengths.untokenizable += 1
                    continue
                problem = prompts and context_problem(max(prompts), requested_max_tokens(bodies[i]), limit)
                if problem:
                    record = failed_request_record(
                        custom_id,
                        ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                        problem,
                        seed=f"{job_id}:{custom_id}" if job_id else None,
                    )
                    rejected.append(
                        StagedRow(
                            custom_id,
                            int(rows["line"][i]),
                            str(rows["source"][i]),
                            ErrorCode.CONTEXT_LENGTH_EXCEEDED.value,
                            0,
                            0,
                            "",
                            dumps(record),
                        )
                    )
                    continue
                output, assumed = target.output_budget(rows["url"][i], bodies[i])
                lengths.add(custom_id, prompts, output, assumed, limit)
        if rejected:
            name = f"{FIT_ERRORS_PREFIX}-{Path(part).stem}.parquet"
            staging.write_rows("errors", rejected, name=name)
            staging.drop_requests(part, {row.custom_id for row in rejected})
    # Counted from the staged parts, not this pass: a pass redone after a crash finds only what is left to reject.
    lengths.too_long = rejected_before(staging)
    lengths.seconds = time.monotonic() - started
    return lengths


def rejected_before(staging: StagingArea) -> int:
    parts = [p for p in staging.parts("errors") if Path(p).name.startswith(f"{FIT_ERRORS_PREFIX}-")]
    return staging.num_rows(parts)


# --- deciding (pure) ---------------------------------------------------------------------------------------------


def fit_max_model_len(lengths: Lengths, block_size: int, limit: int) -> tuple[int | None, str]:
    """The fitted context and why; None when nothing was measured."""
    if not lengths.sequences:
        return None, "no request could be measured: the model's limit is kept"
    context = min(round_up(lengths.longest_need, block_size), limit)
    why = (
        f"longest request {lengths.longest_id!r}: {lengths.longest_prompt_of_longest} prompt + "
        f"{lengths.longest_need - lengths.longest_prompt_of_longest} output tokens = {lengths.longest_need}, "
        f"rounded up to a {block_size}-token KV block"
    )
    if context == limit and round_up(lengths.longest_need, block_size) > limit:
        why += f", capped at the model's limit of {limit}"
    return context, why


def choose_max_num_seqs(
    given: int | None, capacity: KvCapacity | None, context: int, device: str = "cpu"
) -> tuple[int | None, str, str, str | None]:
    """(value, source, why, warning) for one pool's max_num_seqs at max_model_len `context`; value None leaves it
    to the engine (a GPU's KV capacity is known only once vLLM has measured its memory; the runtime reads the
    value back and sizes its in-flight window from it)."""
    fits = capacity.sequences(context) if capacity else None
    held = (
        f"the KV cache ({capacity.tokens:,} tokens) holds {fits} sequences of {context:,} tokens"
        if capacity
        else ""
    )
    if given is not None:
        warning = None
        if fits is not None and given > fits:
            warning = (
                f"max_num_seqs {given} is more than {held}: expect preemptions (recomputation) when outputs run "
                f"long; lower --max-num-seqs to {max(fits, 1)}"
                + ("" if fits else " and --max-model-len, or give the KV cache more memory")
            )
        return given, "given", f"given{'; ' + held if held else ''}", warning
    if capacity is None:
        if device == "cpu":
            return DEFAULT_MAX_NUM_SEQS, "default", "KV capacity unknown before the engine starts", None
        return (
            None,
            "engine",
            "KV capacity is known once the engine has measured its memory: vLLM decides",
            None,
        )
    if fits == 0:
        warning = (
            f"max_model_len {context:,} does not fit one sequence in the KV cache ({capacity.tokens:,} tokens): "
            f"vLLM will refuse to start; give the KV cache more memory (--cpu-kvcache-space) or lower --max-model-len"
        )
        return 1, "fitted", held, warning
    # On CPU cores, past a few hundred sequences a bigger batch only queues: the cap is a CPU rule. A GPU gets
    # every sequence its (known) cache holds.
    value = min(MAX_NUM_SEQS_CAP, fits) if device == "cpu" else fits
    why = held + (f"; capped at {MAX_NUM_SEQS_CAP}" if value < fits else "")
    return value, "fitted", why, None


def unfitted_max_num_seqs(config: JobConfig) -> int | None:
    """max_num_seqs for a vLLM job that was not fitted: the CPU default when every pool computes on CPU cores;
    otherwise the engine's own choice (a fixed CPU value would cap a GPU far below what its cache holds)."""
    if any(pool.gpus_per_engine > 0 for pool in effective_pools(config)):
        return None
    return DEFAULT_MAX_NUM_SEQS


# --- the job's fit ---------------------------------------------------------------------------------------------


def fit_job(config: JobConfig, model: ResolvedModel, staging: StagingArea, state: JobState) -> JobConfig:
    """The job's config with fitted engine args, deciding them once (kept in `state.fit`, i.e. _staging/job.json).

    Uses the lengths ingest measured (state.lengths) when there are; else measures the work list here and
    updates state.input for requests rejected as too long (valid → invalid). Writes the state.
    """
    if state.fit is None:
        # Measured by ingest on the workers (its aggregate is in the state): too-long requests are already error
        # records and out of the valid count. Otherwise (a job ingested without measuring) measured here.
        lengths = Lengths.from_dict(state.lengths) if state.lengths is not None else None
        fit = _decide(config, model, staging, state.job_id, lengths)
        if lengths is None:
            rejected = fit.get("context_length_exceeded", 0)
            state.input.valid -= rejected
            state.input.invalid += rejected
        state.fit = fit
        staging.write_job(state)
    return apply_fit(config, state.fit)


def nothing_to_fit(config: JobConfig) -> bool:
    """Whether the engine args are settled before any request is read — fitting is off, or every arg it fits is
    given — so engines may take requests while ingest still reads them (they run `apply_fit(config, {})`)."""
    if not config.engine.fit.enabled:
        return True
    entry = backend(config.engine.backend)
    if entry.fitting is None:
        return True  # nothing of it can be fitted (a server's engine args are its own)
    if config.engine.vllm.max_model_len is None:
        return False
    if not entry.fits_max_num_seqs:
        return True
    given = config.engine.vllm.max_num_seqs
    return all(
        pool.engine_overrides.get("max_num_seqs", given) is not None for pool in effective_pools(config)
    )


def apply_fit(config: JobConfig, record: dict[str, Any]) -> JobConfig:
    """`config` with the record's fitted values; given values are never replaced."""
    data = config.model_dump()
    vllm = data["engine"]["vllm"]
    fitted_len = record.get("max_model_len") or {}
    if vllm["max_model_len"] is None and fitted_len.get("source") == "fitted":
        vllm["max_model_len"] = fitted_len["value"]
    seqs = {
        name: s["value"]
        for name, s in (record.get("max_num_seqs") or {}).items()
        if s["source"] != "given" and s["value"] is not None  # None: the engine decides
    }
    if config.pools:
        for pool in data["pools"]:
            if pool["name"] in seqs:
                pool["engine_overrides"]["max_num_seqs"] = seqs[pool["name"]]
    elif "default" in seqs:
        vllm["max_num_seqs"] = seqs["default"]
    fits_seqs = backend(config.engine.backend).fits_max_num_seqs
    if fits_seqs and vllm["max_num_seqs"] is None and not record.get("max_num_seqs"):
        vllm["max_num_seqs"] = unfitted_max_num_seqs(config)
    return JobConfig.model_validate(data)


def _decide(
    config: JobConfig,
    model: ResolvedModel,
    staging: StagingArea,
    job_id: str | None,
    lengths: Lengths | None = None,
) -> dict[str, Any]:
    if not config.engine.fit.enabled:
        log.info("engine args not fitted (--no-fit)")
        return {"enabled": False, "reason": "turned off (--no-fit / engine.fit.enabled: false)"}
    if backend(config.engine.backend).fitting is None:
        # Not a failure: this backend's engine args are not nightshift's to fit (an http job's servers).
        reason = backend(config.engine.backend).no_fit_reason
        log.info("engine args not fitted", reason=reason)
        return {"enabled": False, "reason": reason}
    target = fit_target(config, model)
    if isinstance(target, str):
        log.warning("engine args not fitted", reason=target)
        return {"enabled": True, "skipped": target}

    notes, warnings = list(target.notes), []
    pools = effective_pools(config)
    base = config.engine.vllm.model_dump()
    pool_args = {
        p.name: ({**base, **p.engine_overrides}, "gpu" if p.gpus_per_engine > 0 else "cpu") for p in pools
    }
    block = max(target.block_size(args, device) for args, device in pool_args.values())
    limit = target.model_limit
    given_len = config.engine.vllm.max_model_len

    record: dict[str, Any] = {"enabled": True, "counted_by": target.counted_by}
    # Measured even when max_model_len is given: too-long prompts still fail early, and the KV checks below use
    # what the requests need, not only the worst case the given length allows.
    if lengths is None:
        lengths = measure(staging, target, limit, job_id)
    needed, why = fit_max_model_len(lengths, block, limit)
    record["measured"] = lengths.summary()
    record["context_length_exceeded"] = lengths.too_long
    context = given_len or needed or limit
    record["max_model_len"] = {
        "value": context,
        "source": "given" if given_len else "fitted" if needed else "model limit",
        "model_limit": limit,
        "block_size": block,
        "needed": needed,
        "why": why,
    }
    # The longest a sequence can grow: what it needs, when every request bounds its output (a chat without
    # max_tokens may run on to the end of whatever context it is given).
    bound = needed if needed and not lengths.assumed_output else None
    record["longest_sequence"] = bound
    if lengths.too_long:
        warnings.append(
            f"{lengths.too_long} request(s) cannot run within the model's limit of {limit} tokens (a prompt that "
            f"fills it, or a max_tokens that does not fit beside the prompt): recorded as context_length_exceeded, "
            f"not run"
        )
    if given_len and needed and given_len < needed:
        warnings.append(
            f"max_model_len {given_len} is less than these requests need ({needed}: {why}): outputs stop at "
            f"{given_len} tokens, and prompts that long are rejected"
        )
    if lengths.assumed_output:
        notes.append(
            f"{lengths.assumed_output} chat request(s) set no max_tokens: budgeted "
            f"{config.engine.fit.default_max_tokens} output tokens each (engine.fit.default_max_tokens); vLLM "
            f"lets them generate up to max_model_len − prompt, so "
            + (
                "at the fitted length their output may stop there (finish_reason 'length'); set max_tokens, "
                "--max-model-len or --no-fit to keep the model's limit"
                if not given_len and needed
                else "max_num_seqs is sized for sequences of the whole max_model_len"
            )
        )
    if lengths.output_capped:
        notes.append(
            f"{lengths.output_capped} request(s) without max_tokens need more than the model's limit ({limit}) "
            f"for prompt + the default output budget: vLLM cuts their output at the end of the context"
        )
    if lengths.untokenizable:
        warnings.append(
            f"{lengths.untokenizable} request(s) could not be measured (chat template error) and were left to "
            f"the engine, which reports its own error for them"
        )

    record["max_num_seqs"] = {}
    if backend(config.engine.backend).fits_max_num_seqs:
        for name, (args, device) in pool_args.items():
            pool_context = args.get("max_model_len") or context
            sized_for = min(pool_context, bound) if bound else pool_context
            capacity = target.capacity(args, device)
            value, source, why, warning = choose_max_num_seqs(
                args.get("max_num_seqs"), capacity, sized_for, device
            )
            record["max_num_seqs"][name] = {
                "value": value,
                "source": source,
                "sized_for_tokens": sized_for,
                "kv_cache_tokens": capacity.tokens if capacity else None,
                "fits": capacity.sequences(sized_for) if capacity else None,
                "why": why,
            }
            if warning:
                warnings.append(f"pool {name}: {warning}" if len(pool_args) > 1 else warning)
    record["notes"], record["warnings"] = notes, warnings

    log.info(
        "engine args fitted to the data",
        max_model_len=record["max_model_len"]["value"],
        source=record["max_model_len"]["source"],
        max_num_seqs={name: s["value"] for name, s in record["max_num_seqs"].items()} or None,
        **({"measured_s": record["measured"]["seconds"]} if "measured" in record else {}),
    )
    for warning in warnings:
        log.warning(warning)
    return record
