"""`nightshift validate`: the job's first stages run alone on this machine — every line validated against the names
the job serves (its pools' models and their LoRA adapters, from the job's plan), every error record, and, with the
models' tokenizers, token statistics and the lines longer than the context the job would run them with.

No engine and no Ray: the plan is the pure one (`JobPlan.of`, names only) unless tokens are counted, which needs the
models themselves (`JobPlan.resolve`). Each line is measured as fitting measures it (the backend's fit target), so a
line reported too long here is one the job would answer with a context_length_exceeded error record.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pipeline.job_plan import JobPlan, PlannedPool
from pipeline.max_tokens import requested_max_tokens
from pipeline.protocol import ErrorCode, failed_request_record
from pipeline.runtime.ingest.measure import context_problem, fit_target
from pipeline.stages.intake import InputCounts, iter_validated
from pipeline.stages.validate import InvalidLine, LineValidator, ValidRequest


@dataclass
class ValidationReport:
    ingest: InputCounts
    error_records: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    routes: Counter = field(default_factory=Counter)
    counted_by: list[str] = field(default_factory=list)  # how each pool's model counts its prompts
    too_long: int = 0  # valid lines longer than the context the job would run them with
    untokenizable: int = 0  # valid lines whose prompt could not be counted (the engine's to report)
    # A dataset job: its rows that failed to render, by the column to blame ("" when none is).
    template_errors: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        r = self.ingest
        lines = [f"lines      {r.lines} ({r.valid} valid, {r.invalid} invalid)"]
        codes = Counter(r.invalid_by_code)
        if self.too_long:
            codes[ErrorCode.CONTEXT_LENGTH_EXCEEDED.value] += self.too_long
        if codes:
            lines.append("errors     " + ", ".join(f"{c} {n}" for c, n in sorted(codes.items())))
        if self.template_errors:
            blamed = sorted(self.template_errors.items(), key=lambda item: (-item[1], item[0]))
            lines.append(
                "templates  rows not rendered by column: "
                + ", ".join(f"{column or '(no column)'} {n}" for column, n in blamed)
            )
        if self.routes:
            lines.append("routes     " + ", ".join(f"{u} {n}" for u, n in sorted(self.routes.items())))
        if self.prompt_tokens:
            toks = sorted(self.prompt_tokens)
            p95 = toks[min(len(toks) - 1, int(0.95 * len(toks)))]
            lines.append(
                f"prompt     tokens min {toks[0]}, median {int(statistics.median(toks))}, p95 {p95}, max {toks[-1]}, "
                f"total {sum(toks)} ({', '.join(self.counted_by)})"
            )
        if self.untokenizable:
            lines.append(
                f"untokenizable {self.untokenizable} (their templates fail; the engine reports them)"
            )
        lines.append(f"input      {r.source} ({r.size_bytes} bytes, {r.fingerprint})")
        return "\n".join(lines)


class _PoolMeasure:
    """How one pool measures a line: its model's fit target and the context its engines would run with."""

    def __init__(self, plan: JobPlan, pool: PlannedPool) -> None:
        assert pool.model is not None
        target = fit_target(plan.config, pool.model)
        self.target = None if isinstance(target, str) else target
        self.model_name = pool.model.name
        limit = self.target.model_limit if self.target else None
        given = getattr(pool.args, "max_model_len", None)
        # A job whose max_model_len is given runs with it: a line longer than it is refused by the engine.
        if given is None and pool is plan.pools[0]:
            given = plan.config.engine.vllm.max_model_len
        self.context = min(v for v in (limit, given) if v is not None) if (limit or given) else None

    def measure(self, request: ValidRequest) -> list[int] | Exception | None:
        if self.target is None:
            return None
        # An adapter's line runs on its base model: counted as that model's.
        body = {**request.body, "model": self.model_name}
        (prompts,) = self.target.count([(request.url, body)])
        return prompts


def validate_input(location: Any, plan: JobPlan, tokenize: bool = True) -> ValidationReport:
    """Every line of the input at `location` checked as the job would check it (`plan`: pure, or resolved when
    `tokenize`)."""
    report = ValidationReport(InputCounts(source=str(location)))
    validator = LineValidator(plan.validation_map(), None, plan.config.limits)
    measures: dict[str, _PoolMeasure] = {}
    if tokenize:
        served = plan.served
        assert served is not None  # validation_map() above refused a plan whose names are unknown
        by_model: dict[str, _PoolMeasure] = {}
        for pool in plan.pools:
            if pool.served_name not in by_model:
                by_model[pool.served_name] = _PoolMeasure(plan, pool)
                if by_model[pool.served_name].target is not None:
                    report.counted_by.append(by_model[pool.served_name].target.counted_by)
        for name in served.validation_map():
            measures[name] = by_model[served.adapters.get(name, name)]
    renderer = plan.dataset
    for outcome in iter_validated(location, validator, report.ingest, renderer):
        if isinstance(outcome, InvalidLine):
            report.error_records.append(outcome.record)
            continue
        report.routes[outcome.url] += 1
        pool_measure = measures.get(outcome.body["model"]) if measures else None
        if pool_measure is None:
            continue
        prompts = pool_measure.measure(outcome)
        if isinstance(prompts, Exception):
            report.untokenizable += 1
            continue
        if not prompts:
            continue
        # A request may start several sequences (a list of prompts, score pairs): its tokens are their sum.
        report.prompt_tokens.append(sum(prompts))
        problem = pool_measure.context and context_problem(
            max(prompts), requested_max_tokens(outcome.body), pool_measure.context
        )
        if problem:
            report.too_long += 1
            # The record the job writes for it (a request understood but refused, as OpenAI answers it).
            report.error_records.append(
                failed_request_record(outcome.custom_id, ErrorCode.CONTEXT_LENGTH_EXCEEDED, problem)
            )
    if renderer is not None:
        report.template_errors = renderer.failures_by_column
    return report
