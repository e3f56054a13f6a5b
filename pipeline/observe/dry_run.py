"""`nightshift validate`: the job's first stage run alone — counts, every error record, token statistics."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.stages.intake import InputCounts, iter_validated
from pipeline.stages.validate import InvalidLine, LineValidator


@dataclass
class DryRunReport:
    ingest: InputCounts
    error_records: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    routes: Counter = field(default_factory=Counter)
    tokenizer: str | None = None

    def summary(self) -> str:
        r = self.ingest
        lines = [f"lines      {r.lines} ({r.valid} valid, {r.invalid} invalid)"]
        if r.invalid_by_code:
            lines.append("errors     " + ", ".join(f"{c} {n}" for c, n in sorted(r.invalid_by_code.items())))
        if self.routes:
            lines.append("routes     " + ", ".join(f"{u} {n}" for u, n in sorted(self.routes.items())))
        if self.prompt_tokens:
            toks = sorted(self.prompt_tokens)
            p95 = toks[min(len(toks) - 1, int(0.95 * len(toks)))]
            lines.append(
                f"prompt     tokens min {toks[0]}, median {int(statistics.median(toks))}, p95 {p95}, max {toks[-1]}, "
                f"total {sum(toks)} ({self.tokenizer})"
            )
        lines.append(f"input      {r.source} ({r.size_bytes} bytes, {r.fingerprint})")
        return "\n".join(lines)


def _prompt_token_counter(model: str | None, chat_template: str | None = None, runner: str = "auto"):
    """Counts prompt tokens as the engine will (chat template applied); None when no tokenizer is at hand."""
    from pipeline.models import resolve_model
    from pipeline.tokens import PromptCounter

    resolved = resolve_model(model, runner=runner)
    return PromptCounter.for_model(resolved.path, chat_template, resolved.task), resolved


def dry_run(
    path: Path,
    model_name: str,
    model: str | None,
    tokenize: bool = True,
    chat_template: str | None = None,
    runner: str = "auto",
) -> DryRunReport:
    report = DryRunReport(InputCounts(source=str(path)))
    counter = None
    task = None
    if tokenize:
        counter, resolved = _prompt_token_counter(model, chat_template, runner)
        report.tokenizer, task = resolved.name, resolved.task
    # With the model at hand its task is known: a route it cannot serve is reported as the job would.
    for outcome in iter_validated(path, LineValidator({model_name: task}), report.ingest):
        if isinstance(outcome, InvalidLine):
            report.error_records.append(outcome.record)
            continue
        report.routes[outcome.url] += 1
        if counter is not None:
            try:
                # A request may start several sequences (a list of prompts, score pairs): its tokens are their sum.
                report.prompt_tokens.append(sum(counter.count(outcome.url, outcome.body)))
            except Exception:  # noqa: BLE001 - a template failure is the engine's to report, not the dry run's
                pass
    return report
