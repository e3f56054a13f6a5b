"""vLLM's own run-batch, the oracle the real-engine tests compare nightshift's answers with: the same lines, model
and engine args through `python -m vllm.entrypoints.openai.run_batch` in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.lines import read_jsonl, write_lines


def run_batch(
    workdir: Path, name: str, lines: list[str], *args: str, kv_cache_gib: int = 2, env: dict | None = None
) -> dict[str, dict]:
    """Run-batch's output records by custom_id, for `lines` and vLLM's flags `args` (--model, ...); the inputs and
    outputs are kept in `workdir` as `<name>-oracle-{in,out}.jsonl`."""
    oracle_in = write_lines(workdir / f"{name}-oracle-in.jsonl", lines)
    oracle_out = workdir / f"{name}-oracle-out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(oracle_in), "-o", str(oracle_out),
         "--enforce-eager", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **(env or {})},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {record["custom_id"]: record for record in read_jsonl([oracle_out])}


def bodies(records: dict[str, dict]) -> dict[str, dict]:
    """The response body of each record."""
    return {custom_id: record["response"]["body"] for custom_id, record in records.items()}
