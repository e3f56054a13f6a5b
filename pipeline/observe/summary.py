"""The last lines `nightshift run` prints: rows ok/failed, tokens, wall time, throughput, where the output is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from pipeline.fit_record import decision_of, read_fit_record


def summary_lines(manifest: dict[str, Any], output: Path) -> list[str]:
    counts = manifest["counts"]
    tokens = manifest["tokens"]
    throughput = manifest["throughput"]
    by_code = ", ".join(f"{code} {n}" for code, n in counts["by_error_code"].items())
    shards = manifest["shards"]
    lines = [
        f"rows       {counts['total']} total, {counts['succeeded']} ok, {counts['failed']} failed"
        + (f" ({by_code})" if by_code else ""),
        f"tokens     {tokens['prompt']} prompt, {tokens['completion']} completion",
        f"time       {manifest['wall_time_s']:.1f} s wall, {throughput['output_tokens_per_s']:.1f} output tok/s, "
        f"{throughput['rows_per_s']:.1f} rows/s",
    ]
    fitted = fitted_line(manifest.get("engine", {}).get("fitted"))
    if fitted:
        lines.append(f"engine     {fitted}")
    if manifest.get("preemptions"):
        lines.append(
            f"engine     {manifest.get('preemption_warning') or str(manifest['preemptions']) + ' preemptions'}"
        )
    from pipeline.observe.cost import cost_lines

    lines += cost_lines(manifest.get("cost"))
    report = f", {manifest['report']}" if manifest.get("report") else ""
    if manifest.get("dataset"):  # the table back: every row, its errors in its `error` column
        held = f"{len(shards['results'])} table shard(s) of every row with its answer or error"
    else:
        held = f"{len(shards['results'])} result shard(s), {len(shards['errors'])} error shard(s)"
    lines.append(f"output     {output}/ ({held}, manifest.json{report})")
    return lines


def fitted_line(fitted: dict[str, Any] | None) -> str:
    """'max_model_len 512 (fitted), max_num_seqs 22 (fitted), 1 request over the context' — empty when not fitted.
    `fitted`: the manifest's engine.fitted, as written (a fit record, pipeline/fit_record.py)."""
    decision = decision_of(read_fit_record(fitted))
    if decision is None:
        return ""
    length = decision.max_model_len
    parts = [f"max_model_len {length.value} ({length.source})"]
    seqs = decision.max_num_seqs
    if len(seqs) == 1:
        (only,) = seqs.values()
        parts.append(f"max_num_seqs {only.value} ({only.source})")
    elif seqs:
        parts.append("max_num_seqs " + ", ".join(f"{n} {s.value} ({s.source})" for n, s in seqs.items()))
    if decision.context_length_exceeded:
        parts.append(f"{decision.context_length_exceeded} request(s) too long for the model, not run")
    return ", ".join(parts)


def print_summary(manifest: dict[str, Any], output: Path) -> None:
    typer.echo("\n".join(summary_lines(manifest, output)))
