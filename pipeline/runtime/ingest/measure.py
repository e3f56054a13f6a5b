"""Measuring requests as fitting counts them: in the ingest tasks (the common path) or in one pass on the driver.

Every valid request is measured once, where ingest reads it: the ingest tasks on the cluster (runtime/ingest/
tasks.py) are given a `MeasureSpec` and build the backend's FitTarget from it once per worker process
(`fit_target`, cached here; the tokenizer it counts with is loaded once per process too, engines/fitting.py). Only
the aggregate (`pipeline.fit_record.Lengths`, mergeable) reaches the driver.

A work list staged without measuring (a job ingested by an earlier version) is measured on the driver instead
(`measure`: one streaming pass over the request parts, a read batch at a time).

Either way a request that can never run within the model's limit (`context_problem`) becomes a
context_length_exceeded error record where it is measured and stays out of the work list, so it never reaches an
engine and never makes the context of every other request the model's limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import JobConfig
from pipeline.engines.base import backend, fit_strategy
from pipeline.engines.fitting import FitTarget
from pipeline.fit_record import Lengths
from pipeline.io.staging import INGEST_PREFIX, StagedRow, StagingArea
from pipeline.json_codec import loads
from pipeline.max_tokens import requested_max_tokens
from pipeline.models import ResolvedModel
from pipeline.protocol import ErrorCode, dumps, failed_request_record

# Error parts of the driver's pass: named after the request part they came from, so a redone pass replaces them,
# and under the ingest prefix, so they count as rejected before any engine ran (a redone ingest discards them too).
FIT_ERRORS_PREFIX = f"{INGEST_PREFIX}-fit"
READ_BATCH_ROWS = 1024

# Per process: what a worker built once serves every ingest task it runs (a tokenizer takes a second to load).
_FIT_TARGETS: dict[tuple[object, str, str], FitTarget | str] = {}


def fit_target(config: JobConfig, model: ResolvedModel) -> FitTarget | str:
    """What fitting needs from the job's backend (its fit strategy's answer), or why it cannot be fitted; built
    once per process."""
    strategy = fit_strategy(config.engine.backend)
    if strategy is None:
        entry = backend(config.engine.backend)
        return entry.no_fit_reason or f"the {entry.name} backend cannot count tokens"
    key = (strategy, model.model_dump_json(), config.engine.model_dump_json())
    if key not in _FIT_TARGETS:
        args = config.engine.args().model_dump()
        _FIT_TARGETS[key] = strategy(model, args, config.engine.fit.default_max_tokens)
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
    request is rejected for its length, as fitting would not do either)."""
    if not config.engine.fit.enabled:
        return None
    target = fit_target(config, model)
    return None if isinstance(target, str) else MeasureSpec(config, model, target.model_limit)


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
    """Requests the driver's pass (this one or one cut short before it) rejected as too long."""
    parts = [p for p in staging.parts("errors") if Path(p).name.startswith(f"{FIT_ERRORS_PREFIX}-")]
    return staging.num_rows(parts)
