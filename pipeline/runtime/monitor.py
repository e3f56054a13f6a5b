"""The job's monitor: one small Ray actor that engine actors talk to.

- Engine stats: Ray Data actors are not addressable from the driver, so engines push their numbers (every ~2 s)
  and the driver reads them for the progress display and the manifest.
- Attempt ledger: when an engine process dies, Ray restarts the actor and re-runs its unfinished batches. The
  ledger counts how often each request was started. A request caught in one crash is simply retried (the crash
  may have been a lost node or a neighbour's fault); caught in two, it is run alone, so a third crash is surely its
  own — then it is isolated as an `engine_error` record instead of stalling the job. A poison request therefore
  costs at most three engine restarts.
"""

from __future__ import annotations

from typing import Any

SOLO_FROM_ATTEMPT = 3  # the attempt from which a request runs alone


class JobMonitor:
    def __init__(self) -> None:
        self._engines: dict[str, dict[str, Any]] = {}
        self._attempts: dict[str, int] = {}
        self._solo_running: set[str] = (
            set()
        )  # started alone and not finished: if seen again, it killed the engine

    # -- engine stats ---------------------------------------------------------------------------------------
    def report(self, actor_id: str, info: dict[str, Any]) -> None:
        self._engines[actor_id] = info

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return dict(self._engines)

    # -- attempt ledger ---------------------------------------------------------------------------------------
    def begin(self, custom_ids: list[str]) -> dict[str, str]:
        """Register a chunk about to run; returns the requests that must not run normally: "solo" or "isolate".

        Only the exceptions travel back: a chunk can hold thousands of rows and nearly all of them are normal."""
        attempts = self._attempts
        plan: dict[str, str] = {}
        for custom_id in custom_ids:
            count = attempts.get(custom_id, 0) + 1
            attempts[custom_id] = count
            if count == 1:
                continue
            if custom_id in self._solo_running:
                plan[custom_id] = "isolate"  # it ran alone and the engine died: it is the poison
            elif count >= SOLO_FROM_ATTEMPT:
                plan[custom_id] = "solo"
        return plan

    def solo_started(self, custom_id: str) -> None:
        self._solo_running.add(custom_id)

    def solo_finished(self, custom_id: str) -> None:
        self._solo_running.discard(custom_id)

    def retries(self) -> dict[str, int]:
        """Requests started more than once, and how often (a measure of recomputation after failures)."""
        return {k: v for k, v in self._attempts.items() if v > 1}


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


def preemption_remedy(preemptions: int, effective_args: dict[str, Any]) -> str | None:
    """The warning for a KV cache that ran full, with settings that would have fitted (None if it did not).

    vLLM preempts and recomputes when running sequences outgrow the KV cache: throughput drops while the engine
    looks merely slow. Concurrency that fits = KV tokens / context length.
    """
    if preemptions <= 0:
        return None
    kv_tokens = effective_args.get("kv_cache_tokens") or 0
    context = effective_args.get("max_model_len") or 0
    seqs = effective_args.get("max_num_seqs") or 0
    if not kv_tokens or not context or not seqs:
        return f"KV cache full: {preemptions} preemptions; lower max_num_seqs or max_model_len"
    fitting_seqs = max(1, kv_tokens // context)
    fitting_context = max(16, kv_tokens // seqs)
    return (
        f"KV cache full: {preemptions} preemptions; lower max_num_seqs to {min(fitting_seqs, seqs - 1) or 1} "
        f"or max_model_len to {fitting_context} (KV cache: {kv_tokens} tokens)"
    )
