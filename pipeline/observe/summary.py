"""The last lines `nightshift run` prints: rows ok/failed, tokens, wall time, throughput, where the output is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer


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
    if manifest.get("preemptions"):
        lines.append(f"engine     {manifest['preemptions']} preemptions (KV cache full)")
    lines.append(
        f"output     {output}/ ({len(shards['results'])} result shard(s), {len(shards['errors'])} error shard(s), "
        "manifest.json)"
    )
    return lines


def print_summary(manifest: dict[str, Any], output: Path) -> None:
    typer.echo("\n".join(summary_lines(manifest, output)))
