"""LoRA adapters: which names a job serves besides its models, and which model each of them runs on.

A pool serving a base model may also serve LoRA adapters of it (`lora_modules`, vLLM's name: `{name: PATH}`), set
for the job (`--lora-modules name=PATH`, `engine.vllm.lora_modules`) or per pool (`engine_overrides`). A request
whose `model` names an adapter runs on a pool serving its base model, with that adapter; the base model stays
servable in the same job. PATH is a local directory (readable where the engines run), an `s3://` prefix or an
`hf://ORG/NAME` id in the local Hugging Face cache; the engines stage remote ones to their node once
(`pipeline/io/adapter_files.py`).

Pure: pydantic and the standard library only (the driver's preflight and the ingest tasks' validation use it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# vLLM's --lora-modules takes `name=path` or a JSON object {"name": ..., "path": ..., "base_model_name": ...}.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
# vLLM's default --max-lora-rank: an adapter of a higher rank is refused when it loads, i.e. at its first request.
VLLM_DEFAULT_MAX_LORA_RANK = 16
VLLM_DEFAULT_MAX_LORAS = 1
# The max_lora_rank values vLLM takes (vllm/config/lora.py MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def smallest_lora_rank_at_least(rank: int) -> int | None:
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


class AdapterError(ValueError):
    """A LoRA setting that cannot work; the message says what to change."""


def parse_lora_modules(values: list[str], flag: str = "--lora-modules") -> dict[str, str]:
    """`--lora-modules a=/path --lora-modules '{"name": "b", "path": "s3://x/b"}'` -> {"a": "/path", "b": "s3://x/b"}."""
    out: dict[str, str] = {}
    for value in values:
        text = value.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except ValueError as exc:
                raise AdapterError(f"{flag}: {value!r} is not valid JSON ({exc})") from exc
            if (
                not isinstance(obj, dict)
                or not isinstance(obj.get("name"), str)
                or not isinstance(obj.get("path"), str)
            ):
                raise AdapterError(f'{flag}: a JSON adapter needs string "name" and "path", got {value!r}')
            name, path = obj["name"], obj["path"]
        else:
            name, sep, path = text.partition("=")
            if not sep or not name or not path:
                raise AdapterError(f"{flag}: {value!r} must be NAME=PATH (e.g. sql-lora=/models/sql-lora)")
        if name in out and out[name] != path:
            raise AdapterError(f"{flag}: adapter {name!r} is given twice, with {out[name]!r} and {path!r}")
        out[name] = path
    check_adapter_names(out)
    return out


def check_adapter_names(adapters: Mapping[str, str]) -> None:
    for name, path in adapters.items():
        if not _NAME.match(name):
            raise AdapterError(
                f"adapter name {name!r}: use letters, digits and . _ : / @ + - (at most 128), starting with a "
                "letter or digit — requests name it in their `model`"
            )
        if not isinstance(path, str) or not path.strip():
            raise AdapterError(f"adapter {name!r}: its path must be a non-empty string")


@dataclass(frozen=True)
class ServedNames:
    """What a job's requests may name in `model`: each served model and its task, and each adapter's base model."""

    models: dict[str, str | None]  # served model name -> the task vLLM runs it for (None: the engine's)
    adapters: dict[str, str] = field(default_factory=dict)  # adapter name -> the served model it runs on
    paths: dict[str, str] = field(default_factory=dict)  # adapter name -> where it was given

    def validation_map(self) -> dict[str, str | None]:
        """Every name a line may give, with its task (an adapter runs its base model's task)."""
        return {**self.models, **{name: self.models[base] for name, base in self.adapters.items()}}

    def names_of(self, model: str) -> list[str]:
        """The names whose requests run on `model`'s pools: the model's own and its adapters'."""
        return [model, *(name for name, base in self.adapters.items() if base == model)]


def served_names(
    models: Mapping[str, str | None], pool_adapters: list[tuple[str, str, Mapping[str, str]]]
) -> ServedNames:
    """The names a job serves: `models` (name -> task) and, per pool, (pool, its served model, its adapters).

    Refused: an adapter named like a served model, one name for two adapters (two paths, or two base models) —
    a request naming it would not say which it means."""
    adapters: dict[str, str] = {}
    paths: dict[str, tuple[str, str]] = {}  # adapter -> (path, first pool giving it)
    for pool, model, own in pool_adapters:
        for name, path in own.items():
            if name in models:
                raise AdapterError(
                    f"pool {pool}: adapter {name!r} has the name of a served model; give the adapter another name"
                )
            if name in adapters and adapters[name] != model:
                raise AdapterError(
                    f"adapter {name!r} is given for {adapters[name]!r} (pool {paths[name][1]}) and for {model!r} "
                    f"(pool {pool}): one name must mean one adapter"
                )
            if name in paths and paths[name][0] != path:
                raise AdapterError(
                    f"adapter {name!r} has two paths: {paths[name][0]!r} (pool {paths[name][1]}) and {path!r} "
                    f"(pool {pool}): one name must mean one adapter"
                )
            adapters[name] = model
            paths.setdefault(name, (path, pool))
    return ServedNames(dict(models), adapters, {name: path for name, (path, _) in paths.items()})


def adapter_rank(config: Mapping[str, Any], name: str) -> int:
    """An adapter's rank from its adapter_config.json (peft's `r`)."""
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter {name!r}: its adapter_config.json has no positive integer rank `r`")
    return rank


def check_adapter_config(config: Mapping[str, Any], name: str, max_lora_rank: int | None) -> int:
    """What vLLM refuses only when the adapter first loads (at its first request), refused before any work: an
    adapter that is not LoRA, and a rank above max_lora_rank. Returns the rank."""
    kind = config.get("peft_type")
    if kind is not None and str(kind).upper() != "LORA":
        raise AdapterError(f"adapter {name!r} is a {kind} adapter; vLLM serves LoRA adapters only")
    rank = adapter_rank(config, name)
    limit = max_lora_rank or VLLM_DEFAULT_MAX_LORA_RANK
    if rank > limit:
        fits = smallest_lora_rank_at_least(rank)
        raise AdapterError(
            f"adapter {name!r} has rank {rank}, above max_lora_rank {limit}: "
            + (
                f"give --max-lora-rank {fits} (or more) for its pool"
                if fits
                else "vLLM serves ranks up to 512"
            )
        )
    return rank


def lora_slots(args: Mapping[str, Any]) -> tuple[int, int] | None:
    """(max_loras, max_lora_rank) of an engine that serves adapters (engine args), with vLLM's defaults; None
    when it serves none (vLLM then allocates no LoRA slots)."""
    if not args.get("lora_modules"):
        return None
    return (
        int(args.get("max_loras") or VLLM_DEFAULT_MAX_LORAS),
        int(args.get("max_lora_rank") or VLLM_DEFAULT_MAX_LORA_RANK),
    )
