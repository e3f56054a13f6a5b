"""Engine args fitted to the data before the engines start (`nightshift plan --input`, applied to the job): the
decision, on the driver, from the lengths ingest measured (runtime/ingest/measure.py).

- max_model_len, unless given: the longest prompt + its output budget, rounded up to a KV block, capped at the
  model's limit. Halving an oversized context doubles the sequences that fit. No request can need more than the
  fitted length by construction; only one that sets no max_tokens and whose default budget passes the model's own
  limit can, and vLLM cuts its output there.
- max_num_seqs, unless given: the sequences the KV cache holds when every one grows as long as it can (its prompt +
  output budget, at most max_model_len; at most 256), so the engine never has to preempt. A given max_num_seqs
  above that is kept, with a warning that names the number. Requests are measured even when max_model_len is given.
- A request that can never run as asked (its prompt alone reaches the model's limit, or its own max_tokens does not
  fit in what its prompt leaves) was made a `context_length_exceeded` error record where it was measured.

The output budget of a request is what vLLM would allow: max_completion_tokens, else max_tokens; without either,
16 for /v1/completions, the model's generation_config max_new_tokens, else — for chat, where vLLM lets the answer
run to the end of the context (max_tokens = max_model_len − prompt), which cannot be planned for — the configured
default (engine.fit.default_max_tokens, 256). Such a request may still generate up to the fitted max_model_len minus
its prompt; the manifest says how many requests were budgeted that way.

Everything decided is a `FitRecord` (pipeline/fit_record.py) kept in `_staging/job.json` (a resumed job runs with
the same values) and reported in the manifest as `engine.fitted`: what was fitted, from what, and why. What fitting
can know of a backend is its fit strategy's (engines/fitting.py; vllm: the tokenizer and, on CPU, the KV capacity;
fake: its word count, its concurrency is not fitted). A backend whose engine args are not nightshift's (http: the
servers') has none: it is not fitted, and its requests are not measured.
"""

from __future__ import annotations

import math

import structlog

from pipeline.config import DEFAULT_MAX_NUM_SEQS, JobConfig
from pipeline.engines.base import backend
from pipeline.engines.fitting import FitTarget, KvCapacity
from pipeline.fit_record import (
    EarlyFit,
    FitDecision,
    FitOff,
    FitRecord,
    FitSkipped,
    Lengths,
    MaxModelLenFit,
    MaxNumSeqsFit,
    decision_of,
)
from pipeline.io.staging import StagingArea
from pipeline.job_plan import JobPlan
from pipeline.planner import MAX_NUM_SEQS_CAP, round_up
from pipeline.runtime.ingest.measure import fit_target, measure
from pipeline.runtime.ingest.sample import Sample
from pipeline.state import JobState

log = structlog.get_logger(__name__)

# A pool's engine args (the job's engine.vllm with the pool's overrides) and its device ("cpu" or "gpu").
PoolArgs = dict[str, tuple[dict, str]]


# --- the job's fit ---------------------------------------------------------------------------------------------


def fit_job(plan: JobPlan, staging: StagingArea, state: JobState) -> JobPlan:
    """The job's plan with fitted engine args, deciding them once (kept in `state.fit`, i.e. _staging/job.json).

    Uses the lengths ingest measured (state.lengths) when there are; else measures the work list here and
    updates state.input for requests rejected as too long (valid → invalid). Writes the state.
    """
    if state.fit is None:
        # Measured by ingest on the workers (its aggregate is in the state): too-long requests are already error
        # records and out of the valid count. Otherwise (a job ingested without measuring) measured here.
        fit = decide(plan, staging, state.job_id, state.lengths)
        decision = decision_of(fit)
        if state.lengths is None and decision is not None:
            rejected = decision.context_length_exceeded
            state.input.valid -= rejected
            state.input.invalid += rejected
        state.fit = fit
        staging.write_job(state)
    return apply_fit(plan, state.fit)


def nothing_to_fit(plan: JobPlan) -> bool:
    """Whether the engine args are settled before any request is read — fitting is off, or every arg it fits is
    given — so engines may take requests while ingest still reads them (they run `apply_fit(plan, None)`)."""
    config = plan.config
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
    return all(pool.engine_overrides.get("max_num_seqs", given) is not None for pool in plan.pool_configs)


def apply_fit(plan: JobPlan, record: FitRecord | None) -> JobPlan:
    """`plan` with the record's fitted values (None: nothing fitted, yet or at all); given values are never
    replaced."""
    config = plan.config
    decision = decision_of(record)
    data = config.model_dump()
    vllm = data["engine"]["vllm"]
    fitted_len = decision.fitted_max_model_len() if decision else None
    if vllm["max_model_len"] is None and fitted_len is not None:
        vllm["max_model_len"] = fitted_len
    seqs = decision.fitted_max_num_seqs() if decision else {}
    if config.pools:
        for pool in data["pools"]:
            if pool["name"] in seqs:
                pool["engine_overrides"]["max_num_seqs"] = seqs[pool["name"]]
    elif "default" in seqs:
        vllm["max_num_seqs"] = seqs["default"]
    fits_seqs = backend(config.engine.backend).fits_max_num_seqs
    if fits_seqs and vllm["max_num_seqs"] is None and not (decision and decision.max_num_seqs):
        vllm["max_num_seqs"] = unfitted_max_num_seqs(plan)
    return plan.refit(JobConfig.model_validate(data))


def unfitted_max_num_seqs(plan: JobPlan) -> int | None:
    """max_num_seqs for a vLLM job that was not fitted: the CPU default when every pool computes on CPU cores;
    otherwise the engine's own choice (a fixed CPU value would cap a GPU far below what its cache holds)."""
    if any(pool.gpus_per_engine > 0 for pool in plan.pool_configs):
        return None
    return DEFAULT_MAX_NUM_SEQS


# --- the early fit ------------------------------------------------------------------------------------------------

# The early context allows this much more than the sample's longest need: a request longer than the sample's longest
# is held back, and holding any costs an engine restart at the end; on a CPU's known KV cache it costs concurrency.
EARLY_HEADROOM = 1.25


def decide_early(
    plan: JobPlan, staging: StagingArea, job_id: str | None, sample: Sample
) -> FitDecision | None:
    """The args the engines start on before the input is read whole: fitted to the sample's lengths, its longest need
    times EARLY_HEADROOM. None when the sample measured nothing (the exact fit is then waited for)."""
    if not sample.lengths.sequences:
        return None
    lengths = sample.lengths.model_copy()
    lengths.longest_need = math.ceil(lengths.longest_need * EARLY_HEADROOM)
    decision = decision_of(decide(plan, staging, job_id, lengths, stage="early, from a sample"))
    if decision is None or decision.max_model_len.source != "fitted":
        return decision
    context = decision.max_model_len
    why = (
        f"fitted early: the longest need of {sample.lines:,} sampled lines ({sample.lengths.longest_need} tokens, "
        f"{sample.lengths.longest_id!r}) x {EARLY_HEADROOM}, rounded up to a {context.block_size}-token KV block"
    )
    return decision.model_copy(update={"max_model_len": context.model_copy(update={"why": why})})


def hold_above(early: FitDecision) -> int | None:
    """Requests needing more tokens than this wait for the whole input's fit; None: the early context is given or
    the model's limit, so every request that can run at all fits it."""
    return early.fitted_max_model_len()


def settle_early_fit(early: FitDecision, full: FitRecord, sample: Sample, rows_held: int) -> FitRecord:
    """The job's fit record once the whole input is measured (`full`). Without held requests, every request ran on
    the early args: they are the job's (a resumed job runs the same values), with what the whole input measured.
    With held requests, the whole input's fit is the job's: its held rows ran on it, as a resumed job's would."""
    decision = decision_of(full)
    if decision is None:
        return full
    context = early.fitted_max_model_len()
    info = EarlyFit(
        sampled_lines=sample.lines,
        sample_longest_need=sample.lengths.longest_need,
        headroom=EARLY_HEADROOM,
        max_model_len=context,
        max_num_seqs={name: fit.value for name, fit in early.max_num_seqs.items()},
        rows_held=rows_held,
        why=(
            f"engines started on args fitted to {sample.lines:,} lines sampled across the input (longest need "
            f"{sample.lengths.longest_need} tokens x {EARLY_HEADROOM})"
            + (
                f"; {rows_held:,} request(s) needed more than its context of {context} tokens: held back, then run "
                f"on engines fitted to the whole input (max_model_len {decision.max_model_len.value})"
                if rows_held
                else f"; every request fit it (the whole input's longest need: {decision.max_model_len.needed})"
            )
        ),
    )
    if rows_held:
        return decision.model_copy(update={"early": info})
    return decision.model_copy(
        update={"max_model_len": early.max_model_len, "max_num_seqs": early.max_num_seqs, "early": info}
    )


# --- deciding ----------------------------------------------------------------------------------------------------


def decide(
    plan: JobPlan,
    staging: StagingArea,
    job_id: str | None,
    lengths: Lengths | None = None,
    stage: str = "to the data",
) -> FitRecord:
    """The fit record of the job: nothing (off, or not possible), or what was fitted from `lengths` (measured here
    when ingest did not)."""
    config, model = plan.config, plan.model
    if not config.engine.fit.enabled:
        log.info("engine args not fitted (--no-fit)")
        return FitOff(enabled=False, reason="turned off (--no-fit / engine.fit.enabled: false)")
    entry = backend(config.engine.backend)
    if entry.fitting is None:
        # Not a failure: this backend's engine args are not nightshift's to fit (an http job's servers).
        reason = entry.no_fit_reason or f"the {entry.name} backend's engine args are not nightshift's to fit"
        log.info("engine args not fitted", reason=reason)
        return FitOff(enabled=False, reason=reason)
    target = fit_target(config, model)
    if isinstance(target, str):
        log.warning("engine args not fitted", reason=target)
        return FitSkipped(enabled=True, skipped=target)

    pool_args = _pool_args(plan)
    # Measured even when max_model_len is given: too-long prompts still fail early, and the KV checks below use
    # what the requests need, not only the worst case the given length allows.
    if lengths is None:
        lengths = measure(staging, target, target.model_limit, job_id)
    max_model_len = _max_model_len(config, target, pool_args, lengths)
    # The longest a sequence can grow: what it needs, when every request bounds its output (a chat without
    # max_tokens may run on to the end of whatever context it is given).
    needed = max_model_len.needed
    bound = needed if needed and not lengths.assumed_output else None
    notes, warnings = list(target.notes), []
    _explain_lengths(config, max_model_len, lengths, notes, warnings)
    max_num_seqs: dict[str, MaxNumSeqsFit] = {}
    if entry.fits_max_num_seqs:
        max_num_seqs = _max_num_seqs(target, pool_args, max_model_len.value, bound, warnings)
    decision = FitDecision(
        enabled=True,
        counted_by=target.counted_by,
        measured=lengths.summary(),
        context_length_exceeded=lengths.too_long,
        max_model_len=max_model_len,
        longest_sequence=bound,
        max_num_seqs=max_num_seqs,
        notes=notes,
        warnings=warnings,
    )
    log.info(
        f"engine args fitted {stage}",
        max_model_len=max_model_len.value,
        source=max_model_len.source,
        max_num_seqs={name: s.value for name, s in max_num_seqs.items()} or None,
        measured_s=decision.measured.seconds,
    )
    for warning in warnings:
        log.warning(warning)
    return decision


def _pool_args(plan: JobPlan) -> PoolArgs:
    base = plan.config.engine.vllm.model_dump()
    return {p.name: ({**base, **p.engine_overrides}, p.device) for p in plan.pool_configs}


def _max_model_len(
    config: JobConfig, target: FitTarget, pool_args: PoolArgs, lengths: Lengths
) -> MaxModelLenFit:
    """The job's max_model_len: given, else fitted to the lengths, else (nothing measured) the model's limit."""
    block = max(target.block_size(args, device) for args, device in pool_args.values())
    limit = target.model_limit
    given = config.engine.vllm.max_model_len
    needed, why = fit_max_model_len(lengths, block, limit)
    return MaxModelLenFit(
        value=given or needed or limit,
        source="given" if given else "fitted" if needed else "model limit",
        model_limit=limit,
        block_size=block,
        needed=needed,
        why=why,
    )


def _explain_lengths(
    config: JobConfig, context: MaxModelLenFit, lengths: Lengths, notes: list[str], warnings: list[str]
) -> None:
    """What the user should know of the measured requests at this context: added to `notes` and `warnings`."""
    limit, given, needed = context.model_limit, config.engine.vllm.max_model_len, context.needed
    if lengths.too_long:
        warnings.append(
            f"{lengths.too_long} request(s) cannot run within the model's limit of {limit} tokens (a prompt that "
            f"fills it, or a max_tokens that does not fit beside the prompt): recorded as context_length_exceeded, "
            f"not run"
        )
    if given and needed and given < needed:
        warnings.append(
            f"max_model_len {given} is less than these requests need ({needed}: {context.why}): outputs stop at "
            f"{given} tokens, and prompts that long are rejected"
        )
    if lengths.assumed_output:
        notes.append(
            f"{lengths.assumed_output} chat request(s) set no max_tokens: budgeted "
            f"{config.engine.fit.default_max_tokens} output tokens each (engine.fit.default_max_tokens); vLLM "
            f"lets them generate up to max_model_len − prompt, so "
            + (
                "at the fitted length their output may stop there (finish_reason 'length'); set max_tokens, "
                "--max-model-len or --no-fit to keep the model's limit"
                if not given and needed
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


def _max_num_seqs(
    target: FitTarget, pool_args: PoolArgs, context: int, bound: int | None, warnings: list[str]
) -> dict[str, MaxNumSeqsFit]:
    """Per pool: max_num_seqs for sequences that grow to `bound` tokens (None: to the pool's whole context)."""
    out = {}
    for name, (args, device) in pool_args.items():
        pool_context = args.get("max_model_len") or context
        sized_for = min(pool_context, bound) if bound else pool_context
        capacity = target.capacity(args, device)
        value, source, why, warning = choose_max_num_seqs(
            args.get("max_num_seqs"), capacity, sized_for, device
        )
        out[name] = MaxNumSeqsFit(
            value=value,
            source=source,
            sized_for_tokens=sized_for,
            kv_cache_tokens=capacity.tokens if capacity else None,
            fits=capacity.sequences(sized_for) if capacity else None,
            why=why,
        )
        if warning:
            warnings.append(f"pool {name}: {warning}" if len(pool_args) > 1 else warning)
    return out


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
