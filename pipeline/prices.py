"""Prices a job is compared at, parsed where the config is checked: the hosted batch presets
(data/hosted_prices.yaml, user-editable), a hosted price given as INPUT/OUTPUT, and --gpu-hour-price per pool.
What a run then cost is observe/cost.py's, which is given these already parsed."""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

PRESETS_FILE = "data/hosted_prices.yaml"
_PAIR = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*/\s*([0-9]*\.?[0-9]+)\s*$")


def hosted_presets() -> dict[str, dict[str, float]]:
    import yaml

    text = resources.files("pipeline").joinpath(PRESETS_FILE).read_text()
    return {
        name: {"input": float(p["input"]), "output": float(p["output"])}
        for name, p in yaml.safe_load(text).items()
    }


def parse_hosted_price(value: str) -> dict[str, Any]:
    """A preset name or 'INPUT/OUTPUT' (USD per 1M tokens) → {name, input, output}; ValueError says what to give."""
    pair = _PAIR.match(value)
    if pair:
        return {"name": None, "input": float(pair.group(1)), "output": float(pair.group(2))}
    presets = hosted_presets()
    if value in presets:
        return {"name": value, **presets[value]}
    raise ValueError(
        f"unknown hosted price {value!r}: give INPUT/OUTPUT in USD per 1M tokens (e.g. 0.075/0.30) or one of "
        f"{', '.join(sorted(presets))} (pipeline/{PRESETS_FILE}, editable)"
    )


def parse_gpu_hour_prices(values: list[str]) -> dict[str, float]:
    """`--gpu-hour-price 2.5` (every pool) or `--gpu-hour-price cuda=2.5` (one pool), repeatable → {pool|*: price}."""
    out: dict[str, float] = {}
    for value in values:
        pool, _, price = value.rpartition("=")
        try:
            number = float(price)
        except ValueError:
            number = -1.0
        if number < 0:
            raise ValueError(
                f"--gpu-hour-price {value!r}: give a price (e.g. 2.5) or POOL=PRICE (e.g. cuda=2.5)"
            )
        out[pool.strip() or "*"] = number
    return out


def check_pools(prices: dict[str, float], pools: list[str]) -> None:
    unknown = sorted(set(prices) - set(pools) - {"*"})
    if unknown:
        raise ValueError(
            f"--gpu-hour-price names pool(s) {unknown} the job does not have; its pools: {pools}"
        )
