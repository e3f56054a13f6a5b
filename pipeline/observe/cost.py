"""What the job cost on owned hardware against a hosted batch API for the same tokens, and the batch size from
which owning pays.

    owned   = Σ pools: price per accelerator-hour × accelerators held × wall hours of this run
              (accelerators: engines × GPUs per engine; CPU engines: the nodes they ran on, at a node-hour price)
    hosted  = prompt tokens × input price + completion tokens × output price (per 1M)
    start-up (fixed): the seconds before the first engine was ready — ingest, placement, model load — paid once
    per job; the rest of the wall time is paid per token. Owning pays from
    break-even tokens = fixed cost / (hosted − owned marginal cost per token), never when hosted is cheaper at
    the margin.

A pure module. The prices it is given are parsed and checked at the config level (pipeline/prices.py).
"""

from __future__ import annotations

from typing import Any


def job_cost(
    *,
    gpu_hour_price: dict[str, float],
    hosted: dict[str, Any] | None,
    pools: dict[str, dict[str, Any]],
    wall_s: float,
    startup_s: float | None,
    prompt_tokens: int,
    completion_tokens: int,
    rows: int,
) -> dict[str, Any] | None:
    """The manifest's `cost` (None when no price was given). `pools`: per pool, `engines`, `gpus_per_engine` and
    `nodes` (distinct nodes its engines ran on)."""
    if not gpu_hour_price and not hosted:
        return None
    tokens = prompt_tokens + completion_tokens
    per_m = lambda cost: round(cost / tokens * 1e6, 6) if tokens else None  # noqa: E731
    out: dict[str, Any] = {"currency": "USD", "tokens": tokens, "rows": rows, "wall_time_s": round(wall_s, 3)}
    hourly = None
    if gpu_hour_price:
        out["pools"] = {}
        hourly = 0.0
        for name, stats in sorted(pools.items()):
            price = gpu_hour_price.get(name, gpu_hour_price.get("*"))
            if price is None:
                continue
            gpus = stats.get("gpus_per_engine") or 0
            units = stats.get("engines", 0) * gpus if gpus else max(1, stats.get("nodes") or 1)
            out["pools"][name] = {
                "price_per_hour": price,
                "unit": "accelerator" if gpus else "node",
                "units": units,
                "cost": round(price * units * wall_s / 3600, 6),
            }
            hourly += price * units
        owned = hourly * wall_s / 3600
        out["owned_cost"] = round(owned, 6)
        out["owned_per_1m_tokens"] = per_m(owned)
    if hosted:
        cost = (prompt_tokens * hosted["input"] + completion_tokens * hosted["output"]) / 1e6
        out["hosted"] = {
            "preset": hosted.get("name"),
            "input_per_1m": hosted["input"],
            "output_per_1m": hosted["output"],
        }
        out["hosted_cost"] = round(cost, 6)
        out["hosted_per_1m_tokens"] = per_m(cost)
    out["startup_s"] = None if startup_s is None else round(startup_s, 3)
    out["break_even_tokens"] = out["break_even_rows"] = None
    if hourly and hosted and tokens and startup_s is not None:
        fixed = hourly * startup_s / 3600
        marginal = hourly * max(0.0, wall_s - startup_s) / 3600 / tokens
        hosted_per_token = out["hosted_cost"] / tokens
        if hosted_per_token > marginal:
            breakeven = fixed / (hosted_per_token - marginal)
            out["break_even_tokens"] = int(breakeven) + 1
            out["break_even_rows"] = int(breakeven / (tokens / rows)) + 1 if rows else None
    return out


def cost_lines(cost: dict[str, Any] | None) -> list[str]:
    """The summary's cost lines (also the report's)."""
    if not cost:
        return []
    lines = []
    if "owned_cost" in cost:
        per = cost["owned_per_1m_tokens"]
        lines.append(
            f"cost       owned ${cost['owned_cost']:.4f}"
            + (f" = ${per:.4f} per 1M tokens" if per is not None else "")
        )
    if "hosted_cost" in cost:
        hosted = cost["hosted"]
        label = hosted["preset"] or f"{hosted['input_per_1m']}/{hosted['output_per_1m']} per 1M"
        per = cost["hosted_per_1m_tokens"]
        lines.append(
            f"hosted     ${cost['hosted_cost']:.4f} at {label}"
            + (f" = ${per:.4f} per 1M tokens" if per is not None else "")
        )
    if "owned_cost" in cost and "hosted_cost" in cost:
        if cost["break_even_rows"] is not None:
            lines.append(
                f"break-even {cost['break_even_rows']} rows ({cost['break_even_tokens']} tokens) given "
                f"{cost['startup_s']:.0f} s of start-up"
            )
        else:
            lines.append(
                "break-even never: hosted costs less per token than this hardware at this throughput"
            )
    return lines
