"""Per-request usage over a whole job, in bounded memory: token counts and latencies as log-spaced histograms.

Finalize's shard tasks each histogram their own rows (`usage_of`); the driver merges the histograms (`merge`) into
the manifest's percentiles (`distribution`) and the report's length charts. A histogram is a fixed list of bins, so
a million rows cost what a hundred do, and merging is adding lists. Percentiles are read at a bin's upper edge:
with 16 bins per doubling, at most ~4.4% above the true value.

A pure module (pyarrow only).
"""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

BINS_PER_DOUBLING = 16

# What each measured column is, and the smallest value its first bin separates from zero.
USAGE_COLUMNS: dict[str, float] = {
    "prompt_tokens": 1.0,
    "completion_tokens": 1.0,
    "queue_wait_s": 0.001,
    "engine_s": 0.001,
}
# 40 doublings above the floor: 1 → 10^12 tokens, 1 ms → 35 years.
_BINS = 40 * BINS_PER_DOUBLING + 1


def _bin_index(values: pa.Array, floor: float) -> pa.Array:
    """Bin 0 holds values below `floor` (zeros); bin k ≥ 1 holds floor·2^((k-1)/B) ≤ v < floor·2^(k/B)."""
    scaled = pc.divide(pc.cast(values, pa.float64()), floor)
    # log2 of values below the floor is negative or -inf: clipped into bin 0.
    logs = pc.multiply(pc.log2(pc.max_element_wise(scaled, 1e-300)), float(BINS_PER_DOUBLING))
    index = pc.add(pc.floor(logs), 1.0)
    index = pc.min_element_wise(pc.max_element_wise(index, 0.0), float(_BINS - 1))
    return pc.cast(index, pa.int64())


def histogram(values: pa.Array | pa.ChunkedArray, floor: float) -> dict[str, Any]:
    """{count, sum, max, bins: {index: count}} of the non-null values (bins sparse: JSON-sized)."""
    values = values.drop_null()
    if len(values) == 0:
        return {"count": 0, "sum": 0.0, "max": None, "bins": {}}
    counts = pc.value_counts(_bin_index(values, floor)).to_pylist()
    return {
        "count": len(values),
        "sum": float(pc.sum(values).as_py() or 0),
        "max": float(pc.max(values).as_py()),
        "bins": {str(c["values"]): c["counts"] for c in counts},
    }


def usage_of(table: pa.Table) -> dict[str, dict[str, Any]]:
    """Histograms of every usage column `table` holds (finalize calls it per shard)."""
    return {
        name: histogram(table.column(name), floor)
        for name, floor in USAGE_COLUMNS.items()
        if name in table.column_names
    }


def merge(histograms: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for one in histograms:
        for name, h in one.items():
            acc = out.setdefault(name, {"count": 0, "sum": 0.0, "max": None, "bins": {}})
            acc["count"] += h["count"]
            acc["sum"] += h["sum"]
            if h["max"] is not None:
                acc["max"] = h["max"] if acc["max"] is None else max(acc["max"], h["max"])
            for index, n in h["bins"].items():
                acc["bins"][index] = acc["bins"].get(index, 0) + n
    return out


def bin_upper_edge(index: int, floor: float) -> float:
    return 0.0 if index == 0 else floor * 2 ** (index / BINS_PER_DOUBLING)


def bin_lower_edge(index: int, floor: float) -> float:
    return 0.0 if index == 0 else floor * 2 ** ((index - 1) / BINS_PER_DOUBLING)


def percentile(h: dict[str, Any], q: float, floor: float) -> float | None:
    """The q-th percentile (0..100): the upper edge of the bin holding it, never above the largest value seen."""
    if not h["count"]:
        return None
    rank = max(1, math.ceil(q / 100 * h["count"]))
    seen = 0
    for index in sorted(int(i) for i in h["bins"]):
        seen += h["bins"][str(index)]
        if seen >= rank:
            return min(bin_upper_edge(index, floor), h["max"])
    return h["max"]


def distribution(h: dict[str, Any], floor: float) -> dict[str, float | int | None]:
    """What the manifest reports of one column: count, mean, p50, p90, p99, max."""
    digits = 0 if floor >= 1 else 4

    def r(v: float | None) -> float | None:
        return None if v is None else round(v, digits)

    return {
        "count": h["count"],
        "mean": r(h["sum"] / h["count"]) if h["count"] else None,
        "p50": r(percentile(h, 50, floor)),
        "p90": r(percentile(h, 90, floor)),
        "p99": r(percentile(h, 99, floor)),
        "max": r(h["max"]),
    }


def rows_by_model(table: pa.Table) -> dict[str, dict[str, int]]:
    """Rows, prompt and completion tokens per `model` name of the rows an engine answered (rows without a name —
    ingest's error records, parts staged before names were kept — are not counted)."""
    if "model" not in table.column_names or table.num_rows == 0:
        return {}
    named = table.filter(pc.is_valid(table.column("model")))
    if named.num_rows == 0:
        return {}
    grouped = named.group_by("model").aggregate(
        [("model", "count"), ("prompt_tokens", "sum"), ("completion_tokens", "sum")]
    )
    return {
        row["model"]: {
            "rows": int(row["model_count"]),
            "prompt_tokens": int(row["prompt_tokens_sum"] or 0),
            "completion_tokens": int(row["completion_tokens_sum"] or 0),
        }
        for row in grouped.to_pylist()
    }


def merge_rows_by_model(each: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for one in each:
        for name, counts in one.items():
            acc = out.setdefault(name, {"rows": 0, "prompt_tokens": 0, "completion_tokens": 0})
            for key, value in counts.items():
                acc[key] += value
    return out


def structured_of(table: pa.Table) -> dict[str, int]:
    """{requested, parsed_json} of the result rows: rows whose request asked for JSON output, and of them those whose
    every generated text parses as JSON (the staged `structured_json` column, decided where each row was answered).
    Two column sums: nothing is parsed here."""
    if "structured_json" not in table.column_names:
        return {"requested": 0, "parsed_json": 0}
    column = table.column("structured_json")
    return {
        "requested": len(column) - column.null_count,
        "parsed_json": int(pc.sum(column.cast(pa.int64())).as_py() or 0),
    }
