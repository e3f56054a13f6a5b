"""What a batch used, for its OpenAI Batch object: `usage` (token totals) and `model` (the model its lines ran on).

A committed job's come from its manifest: `tokens` (prompt and completion of every row written) and `models` (rows
per served model and LoRA adapter). A batch cut short (cancelled, expired, a job that failed) never committed: its
come from the rows its checkpoint staged, whose parts carry each row's token counts and model name — what finished,
nothing estimated. A batch that staged nothing used nothing: zeros, and the job's own model when its state names
one.

`cached_tokens` and `reasoning_tokens` are always 0: the job counts prompt and completion tokens per row, and vLLM's
answers carry neither split unless asked (`--enable-prompt-tokens-details`, a reasoning parser), so a sum of them
would say "none" where it means "not counted"; the README lists this among the differences from OpenAI."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from pydantic import BaseModel

from pipeline.io.staging import StagingArea
from pipeline.server import outputs
from pipeline.server.schemas import BatchUsage, InputTokensDetails, OutputTokensDetails


class BatchAccount(BaseModel):
    usage: BatchUsage
    model: str | None


def usage_of(prompt: int, completion: int) -> BatchUsage:
    return BatchUsage(
        input_tokens=prompt,
        input_tokens_details=InputTokensDetails(cached_tokens=0),
        output_tokens=completion,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
        total_tokens=prompt + completion,
    )


def rows_per_name(models: dict) -> Counter:
    """Rows per name a line gave (a served model, or a LoRA adapter on one) from the manifest's `models`: a
    model's own rows are its rows less its adapters'."""
    rows: Counter = Counter()
    for name, served in models.items():
        adapters = served.get("adapters") or {}
        for adapter, used in adapters.items():
            rows[adapter] += used.get("rows", 0)
        rows[name] += served.get("rows", 0) - sum(a.get("rows", 0) for a in adapters.values())
    return rows


def main_name(rows: Counter, fallback: str | None) -> str | None:
    """The name most rows ran on (the first such, in the job's order, on a tie); `fallback` when none ran."""
    ran = [(n, name) for name, n in rows.items() if n > 0]
    if not ran:
        return fallback
    most = max(n for n, _ in ran)
    return next(name for n, name in ran if n == most)


def from_manifest(manifest: dict) -> BatchAccount:
    tokens = manifest.get("tokens") or {}
    job_model = (manifest.get("model") or {}).get("name")
    return BatchAccount(
        usage=usage_of(tokens.get("prompt", 0), tokens.get("completion", 0)),
        model=main_name(rows_per_name(manifest.get("models") or {}), job_model),
    )


def from_staging(staging: StagingArea) -> BatchAccount:
    """Sums over the staged rows (results and errors: an engine error may have used prompt tokens)."""
    prompt = completion = 0
    rows: Counter = Counter()
    for kind in outputs.KINDS:
        for part in staging.parts(kind):
            parquet = staging.files.parquet(part)
            # Only the small columns; parts staged before rows named their model have no `model`.
            wanted = [
                c for c in ("prompt_tokens", "completion_tokens", "model") if c in parquet.schema_arrow.names
            ]
            table = parquet.read(columns=wanted, use_threads=False)
            if "prompt_tokens" in wanted:
                prompt += sum(v for v in table.column("prompt_tokens").to_pylist() if v)
            if "completion_tokens" in wanted:
                completion += sum(v for v in table.column("completion_tokens").to_pylist() if v)
            if "model" in wanted:
                rows.update(m for m in table.column("model").to_pylist() if m)
    job_model = None
    try:
        state = staging.read_job()
        job_model = state.model.name if state.model else None
    except Exception:  # noqa: BLE001 - a checkpoint without a readable state: no model to name
        pass
    return BatchAccount(usage=usage_of(prompt, completion), model=main_name(rows, job_model))


def account(out_dir: Path) -> BatchAccount:
    """A batch's usage and model, from its manifest once committed, else from its checkpoint (zeros without one)."""
    if outputs.committed(out_dir):
        return from_manifest(json.loads((out_dir / "manifest.json").read_text()))
    staging = StagingArea(out_dir)
    if staging.exists():
        return from_staging(staging)
    return BatchAccount(usage=usage_of(0, 0), model=None)
