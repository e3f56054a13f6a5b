"""A tiny Ray actor where engine actors post their own numbers; the driver reads it for progress and the manifest.

Ray Data actors are not addressable from the driver, so engines push (every ~2 s) instead of being polled.
"""

from __future__ import annotations

from typing import Any


class EngineMonitor:
    def __init__(self) -> None:
        self._engines: dict[str, dict[str, Any]] = {}

    def report(self, actor_id: str, info: dict[str, Any]) -> None:
        self._engines[actor_id] = info

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return dict(self._engines)


def summarize_engines(snapshot: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Totals over all engines: preemptions, prefix-cache hit rate, KV capacity; plus the first engine's args."""
    preemptions = sum(e["stats"].get("num_preemptions", 0) for e in snapshot.values())
    queries = sum(e["stats"].get("prefix_cache_queries", 0) for e in snapshot.values())
    hits = sum(e["stats"].get("prefix_cache_hits", 0) for e in snapshot.values())
    first = next(iter(snapshot.values()), {})
    return {
        "engines": len(snapshot),
        "num_preemptions": preemptions,
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "kv_cache_tokens_per_engine": first.get("stats", {}).get("kv_cache_tokens"),
        "effective_args": first.get("effective_args", {}),
        "sampling_defaults": first.get("sampling_defaults", {}),
    }
